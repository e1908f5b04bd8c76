/*
 * cffi declarations of the small C shim that build/extension.py compiles into
 * the extension module next to llama.h (cdef syntax; the C side lives in
 * extension.SHIM_SOURCE).
 */

/* "<pin commit> <series hash>" of the tree the module was compiled against;
   runtime/bindings.py refuses a module whose stamp differs from the current checkout. */
const char * pyllama_stamp(void);

/* 1 when libllama exports the HeadInfer residency functions (they are
   referenced weakly, so an older libllama still loads; calling them there
   would jump to NULL, hence this check). */
int pyllama_has_kv_residency(void);

/* sizeof(struct llama_context_params) as the compiler saw it. */
size_t pyllama_sizeof_context_params(void);

/* llama.cpp log callback, routed to the Python logger pyllama_headinfer.llama */
extern "Python" void _pyllama_log_callback(enum ggml_log_level level, const char * text, void * user_data);
