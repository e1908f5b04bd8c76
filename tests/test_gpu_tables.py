"""scripts/gpu_tables.py: the perf and decode tables of a GPU session (the output itself comes from the GPU machine;
this checks the reading and the arithmetic on lines in the tools' formats, written by hand)."""

from __future__ import annotations

import pytest

from testing_scripts import load_script

CASE_A = ("FLASH_ATTN_EXT(hsk=128,hsv=128,nh=8,nr23=[4,1],kv=32768,nb=1,mask=1,sinks=0,max_bias=0.000000,"
          "logit_softcap=0.000000,prec=f32,type_K=f16,type_V=f16,permute=[0,1,2,3],kv_view=1,v_is_view_of_k=0,n_kv_max=0)")
CASE_B = CASE_A.replace("kv=32768", "kv=4096")


def perf_line(case: str, us: float) -> str:
    return f"  {case}:      67095 runs - {us:8.2f} us/run -  67.11 MFLOP/run - \x1b[1;34m  4.44 TFLOPS\x1b[0m"


@pytest.fixture(scope="module")
def tables():
    return load_script("gpu_tables")


def test_perf_compares_each_variants_best_run_of_the_cases_both_have(tables, tmp_path, capsys):
    f = tmp_path / "fa_perf.txt"
    f.write_text("\n".join([
        "== pin", perf_line(CASE_A, 20.0), perf_line(CASE_B, 10.0),
        "== new", perf_line(CASE_A, 22.0), perf_line(CASE_B, 10.2),
        "== pin", perf_line(CASE_A, 21.0),
        "== new", perf_line(CASE_A, 19.0),  # a cut run: only one case
    ]) + "\n")
    cases = tables.perf_cases(f.read_text().splitlines())
    assert cases["pin"] == {CASE_A: 20.0, CASE_B: 10.0}
    assert cases["new"] == {CASE_A: 19.0, CASE_B: 10.2}
    assert tables.main(["perf", str(f)]) == 0
    out = capsys.readouterr().out
    # 19/20 = 0.95 and 10.2/10 = 1.02: geometric mean sqrt(0.969) = 0.984
    assert "over 2 cases: geometric mean 0.984, 1 within 3 %, 2 within 5 %, 0.950 - 1.020" in out


def test_perf_without_a_common_case_is_an_error(tables, tmp_path):
    f = tmp_path / "fa_perf.txt"
    f.write_text("== pin\n" + perf_line(CASE_A, 20.0) + "\n== new\n")
    with pytest.raises(SystemExit, match="no case measured in both"):
        tables.main(["perf", str(f)])


BENCH_HEADER = [
    "| model                          |       size |     params | backend    | ngl |  fa |   hgf |            test |"
    "                  t/s |",
    "| ------------------------------ | ---------: | ---------: | ---------- | --: | --: | ----: | --------------: |"
    " -------------------: |",
]


def bench_row(frac: float, depth: int, tok_s: float) -> str:
    return (f"| llama 8B Q4_K - Medium         |   4.78 GiB |     8.03 B | CUDA       |  99 |   1 | {frac:5.2f} |"
            f"   tg32 @ d{depth} |        {tok_s:.2f} ± 0.00 |")


def test_decode_gives_the_ceiling_and_floor_of_each_fraction(tables, tmp_path, capsys):
    # 1 GiB of KV at 8192 cells (131072 bytes a cell); at f 0.5 512 MiB cross the link: 10 ms at 53.687 GB/s
    f = tmp_path / "decode.md"
    f.write_text("\n".join([
        "== old: llama-bench ...", *BENCH_HEADER, bench_row(1.0, 8192, 200.0), bench_row(0.5, 8192, 90.0),
        "", "build: 0c1e570 (11312)",
        "== new: llama-bench ...", *BENCH_HEADER, bench_row(1.0, 8192, 200.0), bench_row(0.5, 8192, 99.0),
    ]) + "\n")
    rows = tables.decode_rows(f.read_text().splitlines())
    assert rows["old"][8192] == {1.0: 200.0, 0.5: 90.0}
    ceil, floor = tables.ceiling_and_floor(99.0, 200.0, 0.5, 8192, 131072, 2**29 / 0.010)
    assert ceil == pytest.approx(0.99) and floor == pytest.approx(99.0 * 0.015)
    assert tables.main(["decode", str(f), "--cell-bytes", "131072", "--link-gbs", str(2**29 / 0.010 / 1e9)]) == 0
    out = capsys.readouterr().out
    assert "| new | 8192 | 200.0 | 0.5: 99.00 (99.0 %, 148 %) |" in out
    assert "8192: f 1 1.000, f 0.5 1.100" in out
