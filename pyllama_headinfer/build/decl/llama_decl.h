/*
 * cffi declarations of the part of llama.h (patched, pin b11312) that
 * pyllama-headinfer uses.  This is cffi "cdef" syntax, not a C header:
 *
 *   - `...;` at the end of a struct makes it *partial*: the C compiler fills
 *     in size, alignment and offsets from the real header, and every field
 *     named here is checked against it (a missing field is a compile error;
 *     a field of the wrong type is one too, see build/extension.py, which adds
 *     -Werror and a _Static_assert per field and per function).
 *   - `...` in an enum lets the compiler supply the values and the size.
 *   - Only the fields we read or write are named; everything else in the
 *     structs (callbacks, pointers we leave at their defaults) stays hidden.
 *
 * Declare functions with exactly the prototype of llama.h (including const):
 * the build asserts that each declaration has the type of the real function.
 */

/* ---- ggml backend devices (ggml-backend.h, included by llama.h) -------- */
/* Which devices a model's layers go to; RPC servers are added through the
   RPC registry's proc addresses, so builds without GGML_RPC link too. */

typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;

enum ggml_backend_dev_type { GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, ... };

size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type type);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
void ggml_backend_register(ggml_backend_reg_t reg);
size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
size_t ggml_backend_reg_count(void);
/* a GGML_BACKEND_DL build (build --portable): load the backend modules of a directory */
void ggml_backend_load_all_from_path(const char * dir_path);

/* ---- basic types ------------------------------------------------------- */

typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;

struct llama_vocab;
struct llama_model;
struct llama_context;
struct llama_sampler;
typedef struct llama_memory_i * llama_memory_t;

#define LLAMA_DEFAULT_SEED ...
#define LLAMA_TOKEN_NULL ...

/* ---- ggml bits we need ------------------------------------------------- */

enum ggml_type {
    GGML_TYPE_F32,
    GGML_TYPE_F16,
    GGML_TYPE_Q4_0,
    GGML_TYPE_Q4_1,
    GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1,
    GGML_TYPE_Q8_0,
    GGML_TYPE_IQ4_NL,
    GGML_TYPE_BF16,
    ...
};

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE,
    GGML_LOG_LEVEL_DEBUG,
    GGML_LOG_LEVEL_INFO,
    GGML_LOG_LEVEL_WARN,
    GGML_LOG_LEVEL_ERROR,
    GGML_LOG_LEVEL_CONT,
    ...
};

typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);

/* ---- enums of llama.h -------------------------------------------------- */

enum llama_vocab_type {
    LLAMA_VOCAB_TYPE_NONE,
    LLAMA_VOCAB_TYPE_SPM,
    LLAMA_VOCAB_TYPE_BPE,
    LLAMA_VOCAB_TYPE_WPM,
    LLAMA_VOCAB_TYPE_UGM,
    LLAMA_VOCAB_TYPE_RWKV,
    ...
};

enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO,
    LLAMA_FLASH_ATTN_TYPE_DISABLED,
    LLAMA_FLASH_ATTN_TYPE_ENABLED,
    ...
};

enum llama_split_mode { LLAMA_SPLIT_MODE_NONE, LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_ROW, ... };

enum llama_load_mode {
    LLAMA_LOAD_MODE_AUTO,
    LLAMA_LOAD_MODE_NONE,
    LLAMA_LOAD_MODE_MMAP,
    ...
};

/* ---- structs (partial: the compiler lays them out) -------------------- */

typedef struct llama_token_data {
    llama_token id;
    float logit;
    float p;
    ...;
} llama_token_data;

typedef struct llama_token_data_array {
    llama_token_data * data;
    size_t size;
    int64_t selected;
    bool sorted;
    ...;
} llama_token_data_array;

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
    ...;
} llama_batch;

struct llama_model_params {
    ggml_backend_dev_t * devices;   /* NULL-terminated; NULL = all devices */
    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    enum llama_load_mode  load_mode;
    int32_t main_gpu;
    const float * tensor_split;
    bool vocab_only;
    bool check_tensors;
    bool use_extra_bufts;   /* weight repacking (CPU: AMX, AVX-512/NEON repack) */
    ...;
};

/* the file types tests quantize synthetic models to (llama_model_quantize) */
enum llama_ftype {
    LLAMA_FTYPE_ALL_F32,
    LLAMA_FTYPE_MOSTLY_F16,
    LLAMA_FTYPE_MOSTLY_Q4_0,
    LLAMA_FTYPE_MOSTLY_Q8_0,
    LLAMA_FTYPE_MOSTLY_Q4_K_M,
    LLAMA_FTYPE_MOSTLY_Q6_K,
    ...
};

typedef struct llama_model_quantize_params {
    int32_t nthread;
    enum llama_ftype ftype;
    ...;
} llama_model_quantize_params;

enum llama_headinfer_attn_type {
    LLAMA_HEADINFER_ATTN_JOINED,
    LLAMA_HEADINFER_ATTN_CHUNKED,
    ...
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_flash_attn_type flash_attn_type;
    float    headinfer_gpu_heads_frac;   /* HeadInfer (patch series) */
    enum llama_headinfer_attn_type   headinfer_attn;
    uint32_t headinfer_attn_chunk;
    enum ggml_type type_k;
    enum ggml_type type_v;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool op_offload;
    bool swa_full;
    bool kv_unified;
    ...;
};

typedef struct llama_chat_message {
    const char * role;
    const char * content;
    ...;
} llama_chat_message;

typedef struct llama_sampler_chain_params {
    bool no_perf;
    ...;
} llama_sampler_chain_params;

/* HeadInfer KV residency (patch series) */
struct llama_memory_kv_buffer {
    const char * buft_name;
    bool         headinfer_host;
    uint64_t     k_bytes;
    uint64_t     v_bytes;
    ...;
};

struct llama_memory_kv_layer {
    int32_t il;
    int32_t n_head_kv;
    int32_t n_head_resident;
    bool    is_swa;
    ...;
};

/* ---- functions --------------------------------------------------------- */

const char * llama_version(void);
struct llama_model_quantize_params llama_model_quantize_default_params(void);
uint32_t llama_model_quantize(const char * fname_inp, const char * fname_out, const llama_model_quantize_params * params);
const char * llama_print_system_info(void);

struct llama_model_params         llama_model_default_params(void);
struct llama_context_params       llama_context_default_params(void);
struct llama_sampler_chain_params llama_sampler_chain_default_params(void);

void llama_backend_init(void);
void llama_backend_free(void);

void llama_log_set(ggml_log_callback log_callback, void * user_data);

bool llama_supports_gpu_offload(void);
bool llama_supports_mmap(void);
size_t llama_max_devices(void);

/* model */
struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);
int32_t llama_model_n_embd     (const struct llama_model * model);
int32_t llama_model_n_layer    (const struct llama_model * model);
int32_t llama_model_n_head     (const struct llama_model * model);
int32_t llama_model_n_head_kv  (const struct llama_model * model);
int32_t llama_model_n_swa      (const struct llama_model * model);
uint32_t llama_model_headinfer_attn_chunk(const struct llama_model * model); /* HeadInfer (patch series) */
uint64_t llama_model_size      (const struct llama_model * model);
uint64_t llama_model_n_params  (const struct llama_model * model);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);

/* context */
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);
uint32_t llama_n_ctx    (const struct llama_context * ctx);
uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
uint32_t llama_n_batch  (const struct llama_context * ctx);
uint32_t llama_n_ubatch (const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
void llama_synchronize(struct llama_context * ctx);

/* vocab */
enum llama_vocab_type llama_vocab_type(const struct llama_vocab * vocab);
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);

int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);

/* batches and decoding */
struct llama_batch llama_batch_get_one(llama_token * tokens, int32_t n_tokens);
struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);

/* sampling */
struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
int32_t llama_sampler_chain_n(const struct llama_sampler * chain);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
const char * llama_sampler_name(const struct llama_sampler * smpl);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
void llama_sampler_reset(struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);
uint32_t llama_sampler_get_seed(const struct llama_sampler * smpl);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);

/* memory (KV cache) */
llama_memory_t llama_get_memory(const struct llama_context * ctx);
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
void llama_memory_seq_div(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
bool llama_memory_can_shift(llama_memory_t mem);

/* HeadInfer KV residency (patch series; resolved weakly, see pyllama_has_kv_residency) */
int32_t llama_memory_get_kv_buffers(llama_memory_t mem, struct llama_memory_kv_buffer * out, int32_t n_max);
int32_t llama_memory_get_kv_layers(llama_memory_t mem, struct llama_memory_kv_layer * out, int32_t n_max);

/* state */
size_t llama_state_get_size(struct llama_context * ctx);
size_t llama_state_get_data(struct llama_context * ctx, uint8_t * dst, size_t size);
size_t llama_state_set_data(struct llama_context * ctx, const uint8_t * src, size_t size);
bool llama_state_load_file(struct llama_context * ctx, const char * path_session, llama_token * tokens_out,
                           size_t n_token_capacity, size_t * n_token_count_out);
bool llama_state_save_file(struct llama_context * ctx, const char * path_session, const llama_token * tokens,
                           size_t n_token_count);
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
size_t llama_state_seq_save_file(struct llama_context * ctx, const char * filepath, llama_seq_id seq_id,
                                 const llama_token * tokens, size_t n_token_count);
size_t llama_state_seq_load_file(struct llama_context * ctx, const char * filepath, llama_seq_id dest_seq_id,
                                 llama_token * tokens_out, size_t n_token_capacity, size_t * n_token_count_out);
/* sequence state with flags (the tests check LLAMA_STATE_SEQ_FLAGS_ON_DEVICE of split layers) */
#define LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY ...
#define LLAMA_STATE_SEQ_FLAGS_ON_DEVICE ...
typedef uint32_t llama_state_seq_flags;
size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags);
size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id,
                                    llama_state_seq_flags flags);
size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size,
                                    llama_seq_id dest_seq_id, llama_state_seq_flags flags);
