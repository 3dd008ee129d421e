# model binding: owned by the model/forward work (see docs/INTERNALS.md)
#
# CoreModel (a loaded clb_model), KVCache (a clb_kv) and inspect_weight_file. C errors come back
# as Python exceptions carrying the C message: ModelFileNotFoundError (a FileNotFoundError) for
# missing files, FormatError / ShapeError (ValueErrors) for corrupt or mismatched files,
# InputError / ContextOverflowError (ValueErrors) for bad tokens or positions.
# Uses clb_status, clb_type, clb_threadpool and _status_error from _kernels.pxi.

from libc.string cimport strlen

import operator
import threading
import time

from colibri.engine.errors import FormatError, InputError

cdef extern from "clb_model.h" nogil:
    int CLB_ERR_LEN

    ctypedef struct clb_hparams:
        int64_t n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim
        int32_t attn
        int64_t q_lora_rank
        int64_t kv_lora_rank
        int64_t v_head_dim
        float attn_scale
        int64_t n_ff, n_expert, n_expert_used
        int64_t n_ff_shared
        int64_t n_ff_dense
        int32_t shared_gate
        int32_t norm_topk_prob
        int32_t router
        int64_t n_group, topk_group
        float routed_scale
        int32_t qk_norm
        int32_t qkv_bias
        int32_t o_bias
        int32_t tie_embeddings
        float clip_qkv
        float rope_theta
        int64_t rotary_dim
        float rope_scale
        float rms_eps
        int64_t sliding_window
        int32_t attn_sinks
        int64_t attn_chunk
        float attn_temp_floor, attn_temp_scale
        int32_t route_input
        int32_t router_bias
        int32_t expert_bias
        int32_t glu
        float glu_alpha, glu_limit
        int32_t attn_gate
        int64_t lin_n_k_heads, lin_n_v_heads, lin_k_dim, lin_v_dim, lin_conv
        int64_t n_ctx
        const float *rope_freqs
        const int32_t *layer_ffn
        const int32_t *layer_attn
        const int32_t *layer_mixer
        int32_t mtp_input
        int32_t mtp_keep_first

    ctypedef struct clb_tensor:
        const char name[64]
        clb_type type
        int32_t n_dims
        int64_t shape[4]
        const void *data
        size_t nbytes

    ctypedef struct clb_wfile:
        pass
    ctypedef struct clb_model:
        pass
    ctypedef struct clb_kv:
        pass

    clb_status clb_wfile_open(const char *path, clb_wfile **out, char *err)
    void clb_wfile_close(clb_wfile *f)
    int clb_wfile_n_tensors(const clb_wfile *f)
    const clb_tensor *clb_wfile_tensor(const clb_wfile *f, int i)

    clb_status clb_model_load(const char *dir, const clb_hparams *hp, int n_threads,
                              clb_model **out, char *err)
    void clb_model_free(clb_model *m)
    const clb_hparams *clb_model_hparams(const clb_model *m)
    int clb_model_n_threads(const clb_model *m)
    int64_t clb_forward_max_batch()
    int clb_all_finite(const float *x, int64_t n)
    int CLB_PHASE_COUNT
    ctypedef struct clb_phase_stats:
        int64_t n_calls
        int64_t ns
        int64_t weight_bytes
    ctypedef struct clb_product_stats:
        clb_phase_stats phase[6]
        int64_t attention_ns
        int64_t forward_ns
    void clb_model_product_stats(const clb_model *m, clb_product_stats *out)

    int CLB_KV_BLOCK
    ctypedef enum clb_kv_type:
        CLB_KV_F32
        CLB_KV_F16
        CLB_KV_Q8
    size_t clb_kv_block_bytes(const clb_hparams *hp, clb_kv_type type)
    clb_status clb_kv_init(const clb_model *m, int64_t n_blocks, clb_kv_type type, clb_kv **out)
    clb_status clb_kv_init_windowed(const clb_model *m, int64_t n_blocks, int64_t n_win_blocks,
                                    clb_kv_type type, clb_kv **out)
    clb_status clb_kv_split_block_bytes(const clb_hparams *hp, clb_kv_type type, size_t *full,
                                        size_t *win)
    int64_t clb_kv_n_win_blocks(const clb_kv *kv)
    size_t clb_kv_pool_block_bytes(const clb_kv *kv, int windowed)
    void clb_kv_free(clb_kv *kv)
    int64_t clb_kv_n_blocks(const clb_kv *kv)
    clb_kv_type clb_kv_get_type(const clb_kv *kv)
    size_t clb_kv_state_bytes(const clb_hparams *hp)
    clb_status clb_kv_states_init(clb_kv *kv, int64_t n_slots)
    int64_t clb_kv_n_state_slots(const clb_kv *kv)
    clb_status clb_kv_state_copy(clb_kv *kv, int64_t dst, int64_t src)
    clb_status clb_kv_block_copy(clb_kv *kv, int64_t dst, int64_t src)
    int64_t clb_kv_state_len(const clb_kv *kv, int64_t slot)

    ctypedef struct clb_batch:
        int64_t n_tokens
        const int32_t *tokens
        const int32_t *seq_ids
        const int32_t *positions
        const uint8_t *want_logits
        int32_t n_seq
        int32_t max_blocks
        const int32_t *block_tables
        int32_t *routes
        const int32_t *state_slots
        const int32_t *win_tables
        const float *hidden_in
        float *hidden_out
        int32_t hidden_out_normed

    ctypedef struct clb_xc_config:
        int64_t per_layer
        int32_t load
        int32_t prefetch
        int32_t huge_pages
        int64_t prefetch_window
        int64_t read_timeout_ms
        int32_t readers
        int32_t prefetch_depth
        int32_t prefetch_busy_pct
        int32_t prefault

    ctypedef struct clb_xc_stats:
        int64_t hits, misses, loads, evictions
        int64_t prefetch_issued, prefetch_used, prefetch_wasted, prefetch_late
        int64_t bytes_read, stall_ns, reader_loads, prefetch_cancelled
        int64_t prefetch_far, overlapped, prefetch_busy, prefetch_aborted, prefetch_spared
        int64_t predicted, predicted_right

    size_t clb_expert_bytes(const clb_model *m)
    clb_status clb_model_repack(clb_model *m, int experts, int64_t *n_repacked, char *err)
    clb_status clb_xcache_enable(clb_model *m, const clb_xc_config *cfg, const uint8_t *pinned,
                                 char *err)
    int clb_xcache_stats(const clb_model *m, clb_xc_stats *per_layer, int8_t *state, float *heat,
                         int64_t *selections)
    int clb_xcache_timing(const clb_model *m, int64_t *read_ns, int64_t *layer_ns)
    int clb_xcache_prefault(const clb_model *m, int64_t *done_bytes, int64_t *total_bytes,
                            char *err)

    clb_status clb_forward(clb_model *m, clb_kv *kv, const clb_batch *b, float *logits, char *err)
    clb_status clb_forward_span(clb_model *m, clb_kv *kv, const clb_batch *b, int64_t il0,
                                int64_t il1, float *x, float *logits, char *err)
    clb_status clb_moe_experts(clb_model *m, int64_t il, int64_t n_tokens, const float *xn,
                               const int32_t *ids, const float *w, const uint8_t *mine,
                               float *out, char *err)

XC_LOADS = ("pread", "direct", "mmap", "uring")
XC_COUNTERS = ("hits", "misses", "loads", "evictions", "prefetch_issued", "prefetch_used",
               "prefetch_wasted", "prefetch_late", "bytes_read", "stall_ns",
               "reader_loads", "prefetch_cancelled", "prefetch_far", "overlapped",
               "prefetch_busy", "prefetch_aborted", "prefetch_spared", "predicted",
               "predicted_right")

# the types a weight file may hold, by the id it stores
_TYPE_NAMES = {t: name for name, t in PRODUCT_TYPES.items() if clb_type_valid_for_file(t)}

_HPARAM_INT_KEYS = (
    "n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "attn", "q_lora_rank",
    "kv_lora_rank", "v_head_dim", "n_ff", "n_expert", "n_expert_used", "n_ff_shared", "n_ff_dense", "shared_gate", "norm_topk_prob",
    "router", "n_group", "topk_group", "qk_norm", "qkv_bias", "o_bias", "tie_embeddings",
    "rotary_dim", "sliding_window", "attn_sinks", "router_bias", "expert_bias", "glu", "n_ctx",
    "attn_chunk", "route_input",
    "attn_gate", "lin_n_k_heads", "lin_n_v_heads", "lin_k_dim", "lin_v_dim", "lin_conv",
    "mtp_input", "mtp_keep_first",
)
_HPARAM_FLOAT_KEYS = ("attn_scale", "routed_scale", "clip_qkv", "rope_theta", "rope_scale", "rms_eps",
                      "glu_alpha", "glu_limit", "attn_temp_floor", "attn_temp_scale")
# arrays (None: the C default), kept alive by the caller of _fill_hparams while C reads them
_HPARAM_ARRAY_KEYS = ("rope_freqs", "layer_ffn", "layer_attn", "layer_mixer")


def _as_i32(x, str what):
    """x as a contiguous 1-D int32 array; refuses values int32 cannot hold (no silent wrap)."""
    a = np.asarray(x)
    if a.dtype == np.int32:
        return np.ascontiguousarray(a).reshape(-1)
    if a.size and a.dtype.kind not in "iu":
        raise InputError(f"{what} must be integers, got dtype {a.dtype}")
    a = a.reshape(-1)
    if a.size and (int(a.min()) < -2**31 or int(a.max()) >= 2**31):
        raise InputError(f"{what} has values outside the int32 range")
    return np.ascontiguousarray(a, dtype=np.int32)


KV_TYPES = ("f32", "f16", "q8")  # index = clb_kv_type
# index = clb_phase: the weight products of a forward call, by phase of a layer
PRODUCT_PHASES = ("attention projections", "router", "experts gate+up", "experts down",
                  "shared expert", "dense FFN", "lm_head")
assert len(PRODUCT_PHASES) == CLB_PHASE_COUNT
KV_BLOCK = CLB_KV_BLOCK  # positions per KV block


cdef clb_kv_type _kv_type(str name) except *:
    if name not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {name!r}; choose one of {', '.join(KV_TYPES)}")
    cdef int i = KV_TYPES.index(name)
    return <clb_kv_type>i


cdef tuple _fill_hparams(dict hparams, clb_hparams *hp):
    """hp from a ModelConfig.to_hparams() dict; ValueError if a key is missing. Returns the
    arrays hp points into: keep them alive as long as C reads hp."""
    memset(hp, 0, sizeof(clb_hparams))
    missing = [k for k in _HPARAM_INT_KEYS + _HPARAM_FLOAT_KEYS + _HPARAM_ARRAY_KEYS
               if k not in hparams]
    if missing:
        raise ValueError(f"hparams lack {missing}")
    hp.n_vocab = hparams["n_vocab"]
    hp.n_embd = hparams["n_embd"]
    hp.n_layer = hparams["n_layer"]
    hp.n_head = hparams["n_head"]
    hp.n_head_kv = hparams["n_head_kv"]
    hp.head_dim = hparams["head_dim"]
    hp.attn = hparams["attn"]
    hp.q_lora_rank = hparams["q_lora_rank"]
    hp.kv_lora_rank = hparams["kv_lora_rank"]
    hp.v_head_dim = hparams["v_head_dim"]
    hp.attn_scale = hparams["attn_scale"]
    hp.n_ff = hparams["n_ff"]
    hp.n_expert = hparams["n_expert"]
    hp.n_expert_used = hparams["n_expert_used"]
    hp.n_ff_shared = hparams["n_ff_shared"]
    hp.n_ff_dense = hparams["n_ff_dense"]
    hp.shared_gate = hparams["shared_gate"]
    hp.norm_topk_prob = hparams["norm_topk_prob"]
    hp.router = hparams["router"]
    hp.n_group = hparams["n_group"]
    hp.topk_group = hparams["topk_group"]
    hp.routed_scale = hparams["routed_scale"]
    hp.qk_norm = hparams["qk_norm"]
    hp.qkv_bias = hparams["qkv_bias"]
    hp.o_bias = hparams["o_bias"]
    hp.tie_embeddings = hparams["tie_embeddings"]
    hp.clip_qkv = hparams["clip_qkv"]
    hp.rope_theta = hparams["rope_theta"]
    hp.rotary_dim = hparams["rotary_dim"]
    hp.rope_scale = hparams["rope_scale"]
    hp.rms_eps = hparams["rms_eps"]
    hp.sliding_window = hparams["sliding_window"]
    hp.attn_sinks = hparams["attn_sinks"]
    hp.attn_chunk = hparams["attn_chunk"]
    hp.attn_temp_floor = hparams["attn_temp_floor"]
    hp.attn_temp_scale = hparams["attn_temp_scale"]
    hp.route_input = hparams["route_input"]
    hp.router_bias = hparams["router_bias"]
    hp.expert_bias = hparams["expert_bias"]
    hp.glu = hparams["glu"]
    hp.glu_alpha = hparams["glu_alpha"]
    hp.glu_limit = hparams["glu_limit"]
    hp.n_ctx = hparams["n_ctx"]
    hp.attn_gate = hparams["attn_gate"]
    hp.lin_n_k_heads = hparams["lin_n_k_heads"]
    hp.lin_n_v_heads = hparams["lin_n_v_heads"]
    hp.lin_k_dim = hparams["lin_k_dim"]
    hp.lin_v_dim = hparams["lin_v_dim"]
    hp.lin_conv = hparams["lin_conv"]
    hp.mtp_input = hparams["mtp_input"]
    hp.mtp_keep_first = hparams["mtp_keep_first"]
    cdef int32_t[::1] mixers
    cdef float[::1] freqs
    cdef int32_t[::1] kinds
    cdef int32_t[::1] attn
    keep_freqs = keep_kinds = keep_attn = keep_mixers = None
    if hparams["rope_freqs"] is not None:
        keep_freqs = np.ascontiguousarray(hparams["rope_freqs"], dtype=np.float32).reshape(-1)
        if keep_freqs.size != hp.rotary_dim // 2:
            raise ValueError(f"rope_freqs has {keep_freqs.size} values, rotary_dim "
                             f"{hp.rotary_dim} wants {hp.rotary_dim // 2}")
        if keep_freqs.size:
            freqs = keep_freqs
            hp.rope_freqs = &freqs[0]
    if hparams["layer_ffn"] is not None:
        keep_kinds = _as_i32(hparams["layer_ffn"], "layer_ffn")
        if keep_kinds.size != hp.n_layer:
            raise ValueError(f"layer_ffn has {keep_kinds.size} values for {hp.n_layer} layers")
        kinds = keep_kinds
        hp.layer_ffn = &kinds[0]
    if hparams["layer_attn"] is not None:
        keep_attn = _as_i32(hparams["layer_attn"], "layer_attn")
        if keep_attn.size != hp.n_layer:
            raise ValueError(f"layer_attn has {keep_attn.size} values for {hp.n_layer} layers")
        attn = keep_attn
        hp.layer_attn = &attn[0]
    if hparams["layer_mixer"] is not None:
        keep_mixers = _as_i32(hparams["layer_mixer"], "layer_mixer")
        if keep_mixers.size != hp.n_layer:
            raise ValueError(f"layer_mixer has {keep_mixers.size} values for {hp.n_layer} "
                             f"layers")
        mixers = keep_mixers
        hp.layer_mixer = &mixers[0]
    return (keep_freqs, keep_kinds, keep_attn, keep_mixers)


def kv_block_bytes(dict hparams, str kv_type="f32") -> int:
    """Bytes of one KV block (16 positions, K and V, every layer) for a model's hparams
    (ModelConfig.to_hparams) and a KV type: divide a memory budget by it to size a cache."""
    cdef clb_hparams hp
    keep = _fill_hparams(hparams, &hp)  # noqa: F841 (C reads its arrays)
    cdef size_t n = clb_kv_block_bytes(&hp, _kv_type(kv_type))
    if n == 0:
        raise ValueError("hparams give no valid KV block size")
    return n


def kv_split_block_bytes(dict hparams, str kv_type="f32"):
    """(full, windowed): bytes of one block of each pool when the layers that see only a
    sliding window or their own chunk keep a pool of their own (KVCache n_win_blocks > 0);
    None when the model has no such split (no windowed layer, no other one, or not GQA)."""
    cdef clb_hparams hp
    keep = _fill_hparams(hparams, &hp)  # noqa: F841 (C reads its arrays)
    cdef size_t full = 0, win = 0
    if clb_kv_split_block_bytes(&hp, _kv_type(kv_type), &full, &win) != CLB_OK:
        return None
    return int(full), int(win)


def all_finite(const float[:, ::1] x) -> bool:
    """True when every value of the float32 array x (2-D, C-contiguous) is finite."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        return True
    return clb_all_finite(&x[0, 0], x.shape[0] * x.shape[1]) != 0


def _as_tables(x, str what="block_tables"):
    """block_tables as a C-contiguous int32 [n_seq, max_blocks] array, checked, never copied
    from another dtype silently."""
    if not isinstance(x, np.ndarray):
        raise InputError(f"{what} must be a numpy int32 array, got {type(x).__name__}")
    if x.dtype != np.int32:
        raise InputError(f"{what} must have dtype int32, got {x.dtype}")
    if x.ndim != 2:
        raise InputError(f"{what} must be 2-D [n_seq, max_blocks], got shape {x.shape}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise InputError(f"{what} must have at least one row and column, got {x.shape}")
    if x.shape[0] >= 2**31 or x.shape[1] >= 2**31:
        raise InputError(f"{what} shape {x.shape} is too large")
    if not x.flags.c_contiguous:
        raise InputError(f"{what} must be C-contiguous (np.ascontiguousarray)")
    return x


cdef bytes _fs_path(path):
    import os
    return os.fsencode(os.fspath(path))


def inspect_weight_file(path) -> list:
    """Validate one Colibri .bin file with the C loader and list its tensors.

    Returns [{"name", "dtype", "shape", "nbytes"}, ...] in table order; raises the same
    exceptions as model loading (FormatError for any violation of the format).
    """
    cdef bytes p = _fs_path(path)
    cdef const char *cp = p
    cdef char err[512]
    cdef clb_wfile *f = NULL
    cdef clb_status st
    err[0] = 0
    with nogil:
        st = clb_wfile_open(cp, &f, err)
    if st != CLB_OK:
        raise _status_error(st, err)
    out = []
    cdef const clb_tensor *t
    cdef const char *nm
    try:
        for i in range(clb_wfile_n_tensors(f)):
            t = clb_wfile_tensor(f, i)
            nm = t.name
            out.append({
                "name": nm[:strlen(nm)].decode("utf-8", "replace"),
                "dtype": _TYPE_NAMES.get(<int>t.type, str(<int>t.type)),
                "shape": tuple(t.shape[d] for d in range(t.n_dims)),
                "nbytes": t.nbytes,
            })
    finally:
        clb_wfile_close(f)
    return out


cdef class KVCache:
    """Paged KV cache: n_blocks blocks of 16 positions (K and V, every layer) shared by all
    sequences, element type "f32", "f16" or "q8". Which block holds which positions is given
    by the block tables passed to CoreModel.forward; the cache keeps no sequence state.
    n_win_blocks > 0 keeps the layers that see only a sliding window or their own chunk in a
    second pool of that many blocks, addressed by forward's win_tables."""

    cdef clb_kv *kv
    cdef readonly CoreModel model

    def __cinit__(self):
        self.kv = NULL

    def __init__(self, CoreModel model not None, n_blocks, str kv_type="f32", n_state_slots=0,
                 n_win_blocks=0):
        cdef clb_kv_type ty = _kv_type(kv_type)
        n = operator.index(n_blocks)
        if n <= 0 or n > 2**31 - 1:
            raise ValueError(f"n_blocks must be in 1..{2**31 - 1}, got {n}")
        nw = operator.index(n_win_blocks)
        if nw < 0 or nw > 2**31 - 1:
            raise ValueError(f"n_win_blocks must be in 0..{2**31 - 1}, got {nw}")
        cdef size_t fb = 0, wb = 0
        if nw > 0 and clb_kv_split_block_bytes(clb_model_hparams(model.m), ty, &fb,
                                                &wb) != CLB_OK:
            raise ValueError("this model has no sliding-window or chunked layers beside full "
                             "ones to keep in a pool of their own (n_win_blocks must be 0)")
        cdef clb_kv *kv = NULL
        cdef clb_status st = clb_kv_init_windowed(model.m, n, nw, ty, &kv)
        if st != CLB_OK:
            raise _status_error(st, f"a KV cache of {n} blocks does not fit the address space"
                                if st == CLB_E_RANGE
                                else f"cannot allocate a KV cache of {n} {kv_type} blocks",
                                range_cls=MemoryError)
        if self.kv != NULL:
            clb_kv_free(self.kv)
        self.kv = kv
        self.model = model
        ns = operator.index(n_state_slots)
        if ns > 0 and clb_kv_state_bytes(clb_model_hparams(model.m)) > 0:
            st = clb_kv_states_init(kv, ns)
            if st != CLB_OK:
                raise _status_error(st, f"cannot allocate {ns} recurrent-state slots",
                                    range_cls=MemoryError)

    def __dealloc__(self):
        if self.kv != NULL:
            clb_kv_free(self.kv)
            self.kv = NULL

    @property
    def n_blocks(self) -> int:
        return clb_kv_n_blocks(self.kv)

    @property
    def n_win_blocks(self) -> int:
        """Blocks of the windowed pool (0: every layer caches in the one pool)."""
        return clb_kv_n_win_blocks(self.kv)

    @property
    def win_block_bytes(self) -> int:
        """Bytes of one windowed-pool block as allocated (0 without that pool)."""
        return clb_kv_pool_block_bytes(self.kv, 1)

    @property
    def kv_type(self) -> str:
        return KV_TYPES[<int>clb_kv_get_type(self.kv)]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the (full) pool as allocated: every cached layer's, or the
        full layers' only when a windowed pool holds the others."""
        return clb_kv_pool_block_bytes(self.kv, 0)

    @property
    def n_state_slots(self) -> int:
        """Recurrent-state slots (models with linear-attention layers; 0 otherwise)."""
        return clb_kv_n_state_slots(self.kv)

    @property
    def state_bytes(self) -> int:
        """Bytes of one recurrent-state slot (0 without linear-attention layers)."""
        return clb_kv_state_bytes(clb_model_hparams(self.model.m))

    def state_len(self, slot) -> int:
        """Positions state slot `slot` has absorbed (-1: none usable)."""
        return clb_kv_state_len(self.kv, operator.index(slot))

    def copy_block(self, dst, src):
        """Make block dst hold what block src holds, every layer (a fork's own copy of a
        partly filled block)."""
        cdef clb_status st = clb_kv_block_copy(self.kv, operator.index(dst), operator.index(src))
        if st != CLB_OK:
            raise InputError(f"blocks {dst} and {src} must be in 0..{self.n_blocks - 1}")

    def copy_state(self, dst, src):
        """Make state slot dst what slot src is (a sequence forked from another)."""
        cdef clb_status st = clb_kv_state_copy(self.kv, operator.index(dst), operator.index(src))
        if st != CLB_OK:
            raise InputError(f"state slots {dst} and {src} must be in "
                             f"0..{clb_kv_n_state_slots(self.kv) - 1}")


cdef class CoreModel:
    """A model folder loaded by the C core; forward runs with the GIL released.

    One forward at a time per model (the C scratch is per model): calls from several threads
    are serialised by a lock.
    """

    cdef clb_model *m
    cdef object _lock
    cdef readonly int64_t n_repacked  # matrices repack() copied, all calls

    def __cinit__(self):
        self.m = NULL
        self._lock = threading.Lock()
        self.n_repacked = 0

    def __dealloc__(self):
        if self.m != NULL:
            clb_model_free(self.m)
            self.m = NULL

    @staticmethod
    def load(path, dict hparams, int n_threads=0) -> CoreModel:
        """Map and validate the model folder `path` against `hparams` (ModelConfig.to_hparams)."""
        cdef clb_hparams hp
        keep = _fill_hparams(hparams, &hp)  # noqa: F841 (C reads its arrays during the load)
        cdef bytes p = _fs_path(path)
        cdef const char *cp = p
        cdef char err[512]
        cdef clb_model *m = NULL
        cdef clb_status st
        err[0] = 0
        with nogil:
            st = clb_model_load(cp, &hp, n_threads, &m, err)
        if st != CLB_OK:  # hparams refused at load are a config problem, not user input
            raise _status_error(st, err, arg_cls=FormatError)
        cdef CoreModel self = CoreModel.__new__(CoreModel)
        self.m = m
        return self

    @property
    def n_threads(self) -> int:
        return clb_model_n_threads(self.m)

    def product_stats(self) -> dict:
        """The forward pass's weight products since load, timed in place, per phase
        (PRODUCT_PHASES; every product is in exactly one): calls, seconds (activation packing
        and thread hand-offs included) and weight bytes read; with them the seconds of
        attention over the KV cache and of the forward calls, whole."""
        cdef clb_product_stats ps
        with self._lock:  # between forward calls
            clb_model_product_stats(self.m, &ps)
        phases = {name: {"calls": ps.phase[i].n_calls, "s": ps.phase[i].ns * 1e-9,
                         "weight_bytes": ps.phase[i].weight_bytes}
                  for i, name in enumerate(PRODUCT_PHASES)}
        return {"phases": phases, "attention_s": ps.attention_ns * 1e-9,
                "forward_s": ps.forward_ns * 1e-9}

    @property
    def n_vocab(self) -> int:
        return clb_model_hparams(self.m).n_vocab

    @property
    def n_ctx(self) -> int:
        return clb_model_hparams(self.m).n_ctx

    @property
    def max_batch(self) -> int:
        """Tokens per internal chunk; longer forward calls are split, same result."""
        return clb_forward_max_batch()

    def kv_block_bytes(self, str kv_type="f32") -> int:
        """Bytes of one KV block of this model (16 positions, K and V, every layer)."""
        return clb_kv_block_bytes(clb_model_hparams(self.m), _kv_type(kv_type))

    @property
    def expert_bytes(self) -> int:
        """Bytes one routed expert takes in the expert cache (its three matrices)."""
        return clb_expert_bytes(self.m)

    def repack(self, bint experts) -> int:
        """Copies the weights the forward pass multiplies into the layout this CPU's kernels
        read fastest, if that is not the file's (tokens do not change): attention, shared
        experts, lm_head, and the routed experts when `experts` (not with the expert cache,
        which repacks what it loads). Call before the first forward; returns the number of
        matrices copied."""
        cdef char err[512]
        cdef clb_status st
        cdef int64_t n = 0
        err[0] = 0
        with self._lock:
            with nogil:
                st = clb_model_repack(self.m, 1 if experts else 0, &n, err)
        self.n_repacked += n
        if st != CLB_OK:
            raise _status_error(st, err)
        return n

    def enable_expert_cache(self, int per_layer, str load="pread", bint prefetch=True,
                            bint huge_pages=False, int prefetch_window=16, pinned=None,
                            double read_timeout_s=30.0, int readers=4,
                            int prefetch_depth=0, int prefetch_busy_pct=50,
                            bint prefault=True) -> None:
        """Keep at most per_layer routed experts of each layer resident, loaded on demand.

        load: "pread", "direct" (O_DIRECT), "mmap" (madvise on the mappings) or "uring"
        (O_DIRECT, each read in chunks all in flight through the reader's io_uring); pinned: bool
        [n_layer, n_expert] experts loaded now and never evicted, or None; read_timeout_s:
        one read that takes longer fails the model (a forward raises, naming the file) instead
        of blocking; readers: threads that load experts in parallel (1..64), the prefetches
        included; prefetch_depth: layers read ahead, 1 or 2, or 0 for two while one read takes
        longer than a layer's compute (see expert_cache_timing); prefetch_busy_pct (1..100): no
        prefetch read starts while loads the forward waits for kept the storage busy more than
        this share of the recent time (nor while one is queued or being read); prefault:
        fault the slots' memory in once, on a thread of its own (see expert_cache_prefault),
        so that reads into the slots do not wait for the kernel to zero their pages. Call once,
        before the first forward. Outputs do not change; only speed and memory do.
        """
        cdef clb_xc_config cfg
        if load not in XC_LOADS:
            raise ValueError(f"expert load mode must be one of {', '.join(XC_LOADS)}, got {load!r}")
        cfg.per_layer = per_layer
        cfg.load = XC_LOADS.index(load)
        cfg.prefetch = 1 if prefetch else 0
        cfg.huge_pages = 1 if huge_pages else 0
        cfg.prefetch_window = prefetch_window
        if not 0 < read_timeout_s <= 86400:
            raise ValueError(f"read_timeout_s must be in (0, 86400], got {read_timeout_s}")
        cfg.read_timeout_ms = max(1, <int64_t>(read_timeout_s * 1000))
        if not 1 <= readers <= 64:
            raise ValueError(f"readers must be in 1..64, got {readers}")
        cfg.readers = readers
        if not 0 <= prefetch_depth <= 2:
            raise ValueError(f"prefetch_depth must be 0 (automatic), 1 or 2, got {prefetch_depth}")
        cfg.prefetch_depth = prefetch_depth
        if not 1 <= prefetch_busy_pct <= 100:
            raise ValueError(f"prefetch_busy_pct must be in 1..100, got {prefetch_busy_pct}")
        cfg.prefetch_busy_pct = prefetch_busy_pct
        cfg.prefault = 1 if prefault else 0
        cdef const clb_hparams *hp = clb_model_hparams(self.m)
        cdef uint8_t[::1] pv
        cdef const uint8_t *pp = NULL
        if pinned is not None:
            pa = np.ascontiguousarray(np.asarray(pinned, dtype=bool).reshape(-1)).view(np.uint8)
            if pa.shape[0] != hp.n_layer * hp.n_expert:
                raise ValueError(f"pinned has {pa.shape[0]} entries, the model has "
                                 f"{hp.n_layer * hp.n_expert} experts")
            pv = pa
            pp = &pv[0]
        cdef char err[512]
        cdef clb_status st
        err[0] = 0
        with self._lock:
            with nogil:
                st = clb_xcache_enable(self.m, &cfg, pp, err)
        if st != CLB_OK:
            raise _status_error(st, err, arg_cls=ValueError)

    def expert_cache_stats(self):
        """None without an expert cache; else a dict of numpy arrays: per-layer counters
        (hits, misses, loads, evictions, prefetch_issued, prefetch_used, prefetch_wasted,
        prefetch_late, bytes_read, stall_ns, reader_loads, prefetch_cancelled, prefetch_far,
        overlapped, prefetch_busy, prefetch_aborted, prefetch_spared, predicted,
        predicted_right: int64 [n_layer]) and per expert ([n_layer,
        n_expert]) state (0 absent, 1 loading, 2 resident, 3 pinned), heat and selections."""
        cdef const clb_hparams *hp = clb_model_hparams(self.m)
        cdef int64_t L = hp.n_layer, E = hp.n_expert
        if E == 0:  # a dense model: no experts, so never an expert cache
            return None
        counters = np.zeros((L, len(XC_COUNTERS)), dtype=np.int64)
        state = np.zeros((L, E), dtype=np.int8)
        heat = np.zeros((L, E), dtype=np.float32)
        sel = np.zeros((L, E), dtype=np.int64)
        cdef int64_t[:, ::1] cv = counters
        cdef int8_t[:, ::1] sv = state
        cdef float[:, ::1] hv = heat
        cdef int64_t[:, ::1] lv = sel
        cdef int on
        with nogil:
            on = clb_xcache_stats(self.m, <clb_xc_stats *>&cv[0, 0], &sv[0, 0], &hv[0, 0],
                                  &lv[0, 0])
        if not on:
            return None
        out = {name: counters[:, i].copy() for i, name in enumerate(XC_COUNTERS)}
        out.update(state=state, heat=heat, selections=sel)
        return out

    def moe_experts(self, int il, xn, ids, weights, mine, out) -> None:
        """The routed experts of MoE layer il that `mine` marks (clb_moe_experts), with the GIL
        released: xn float32 [T, n_embd] the normed FFN inputs, ids int32 and weights float32
        [T, n_expert_used] the routing, mine bool/uint8 [n_expert], out float32 [T, n_embd]
        (C-contiguous) receives those experts' weighted sum per token. InputError for a layer
        without experts or an expert id out of range."""
        cdef const clb_hparams *hp = clb_model_hparams(self.m)
        cdef int64_t D = hp.n_embd, K = hp.n_expert_used
        x = np.ascontiguousarray(xn, dtype=np.float32)
        cdef Py_ssize_t T = x.shape[0] if x.ndim == 2 else -1
        if x.ndim != 2 or x.shape[1] != D:
            raise InputError(f"xn must be float32 [T, {D}]")
        i = np.ascontiguousarray(ids, dtype=np.int32)
        wt = np.ascontiguousarray(weights, dtype=np.float32)
        if i.shape != (T, K) or wt.shape != (T, K):
            raise InputError(f"ids and weights must be [{T}, {K}]")
        mk = np.ascontiguousarray(np.asarray(mine, dtype=bool).reshape(-1)).view(np.uint8)
        if mk.shape[0] != hp.n_expert:
            raise InputError(f"mine has {mk.shape[0]} entries, the model has {hp.n_expert} "
                             "experts per layer")
        if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (T, D)
                or not out.flags.c_contiguous):
            raise InputError(f"out must be a C-contiguous float32 array of shape ({T}, {D})")
        if T == 0:
            return
        cdef const float[:, ::1] xv = x
        cdef const int32_t[:, ::1] iv = i
        cdef const float[:, ::1] wv = wt
        cdef const uint8_t[::1] mv = mk
        cdef float[:, ::1] ov = out
        cdef char err[512]
        cdef clb_status st
        err[0] = 0
        with self._lock:
            with nogil:
                st = clb_moe_experts(self.m, il, T, &xv[0, 0], &iv[0, 0], &wv[0, 0], &mv[0],
                                     &ov[0, 0], err)
        if st != CLB_OK:
            raise _status_error(st, err)

    def expert_cache_timing(self):
        """None without an expert cache; else what the L+2 read-ahead is decided on: read_ns
        (one reader's read of one expert, averaged), layer_ns (one layer's compute, averaged;
        both 0 until measured) and prefetch_depth (layers read ahead now: 0 without prefetch,
        1 or 2)."""
        cdef int64_t read_ns = 0, layer_ns = 0
        cdef int depth
        with nogil:
            depth = clb_xcache_timing(self.m, &read_ns, &layer_ns)
        if depth < 0:
            return None
        return {"read_ns": int(read_ns), "layer_ns": int(layer_ns), "prefetch_depth": depth}

    def expert_cache_prefault(self, double wait_s=0.0):
        """None without an expert cache; else how far the slots' pre-fault has come: done and
        total bytes (the slots of the layers with experts; 0 in mmap mode, which has none),
        running, and error (why it stopped early, else ""). wait_s: first wait up to that long
        for it to end."""
        cdef int64_t done = 0, total = 0
        cdef int running
        cdef char err[512]
        deadline = time.monotonic() + wait_s
        while True:
            err[0] = 0
            with nogil:
                running = clb_xcache_prefault(self.m, &done, &total, err)
            if running != 1 or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        if running < 0:
            return None
        return {"done_bytes": int(done), "total_bytes": int(total), "running": running == 1,
                "error": err.decode("utf-8", "replace")}

    def forward(self, KVCache kv not None, tokens, seq_ids, positions, want_logits,
                block_tables, routes=None, state_slots=None, win_tables=None, span=None,
                hidden=None, hidden_in=None, hidden_out=None, hidden_normed=False):
        """Run one step; returns float32 logits [n_out, n_vocab] for the rows that want them.

        tokens, seq_ids, positions: int32 [T] (other integer arrays are converted when their
        values fit); want_logits: bool/uint8 [T] or None (all rows); block_tables: int32
        [n_seq, max_blocks], C-contiguous: entry [s, j] is the block holding positions
        [16j, 16j+16) of sequence s (-1: none). Token i writes its K/V into its sequence's
        block for its position and attends over the positions before it, which earlier calls
        must have written. A refused call (InputError / ContextOverflowError) changes nothing.
        routes: None, or an int32 array [T, n_layer, n_expert_used] (C-contiguous) that
        receives the experts each token chose in each layer. state_slots: None, or int32
        [n_seq]: each sequence's recurrent-state slot (models with linear attention).
        win_tables: None, or (a cache with a windowed pool, where it is needed) int32 tables
        shaped like block_tables into that pool; entries the call's windows do not reach may
        be -1.
        span (il0, il1) with hidden, float32 [T, n_embd] C-contiguous: only layers [il0, il1)
        (clb_forward_span), from hidden's states unless il0 is 0, leaving the states after
        them in hidden; the logits come only from a span that ends at the last layer.
        hidden_in: float32 [T, n_embd] (C-contiguous), each token's previous hidden state: needed
        by a multi-token-prediction layer (mtp_input), ignored otherwise. hidden_out: None, or
        a float32 array [T, n_embd] that receives every token's hidden state after the last
        layer: before the final norm, or after it with hidden_normed.
        """
        if kv.model is not self:
            raise ValueError("this KV cache belongs to another model")
        cdef int32_t[::1] tk = _as_i32(tokens, "tokens")
        cdef int32_t[::1] sq = _as_i32(seq_ids, "seq_ids")
        cdef int32_t[::1] ps = _as_i32(positions, "positions")
        cdef Py_ssize_t n = tk.shape[0]
        if sq.shape[0] != n or ps.shape[0] != n:
            raise InputError(f"tokens ({n}), seq_ids ({sq.shape[0]}) and positions "
                             f"({ps.shape[0]}) differ in length")
        bt = _as_tables(block_tables)
        cdef const int32_t[:, ::1] tb = bt
        cdef uint8_t[::1] wl
        cdef const uint8_t *wp = NULL
        cdef Py_ssize_t n_out = n
        if want_logits is not None:
            w = np.asarray(want_logits)
            if w.dtype != np.bool_ and w.dtype != np.uint8:
                raise InputError(f"want_logits must be bool or uint8, got dtype {w.dtype}")
            wl = np.ascontiguousarray(w.reshape(-1)).view(np.uint8)
            if wl.shape[0] != n:
                raise InputError(f"want_logits has {wl.shape[0]} entries for {n} tokens")
            n_out = int(np.count_nonzero(np.asarray(wl)))
            if n > 0:
                wp = &wl[0]
        cdef int64_t V = clb_model_hparams(self.m).n_vocab
        cdef int64_t il0 = 0, il1 = clb_model_hparams(self.m).n_layer
        cdef float[:, ::1] hv
        cdef float *hp_x = NULL
        if span is not None:
            il0, il1 = int(span[0]), int(span[1])
            if (not isinstance(hidden, np.ndarray) or hidden.dtype != np.float32
                    or hidden.shape != (n, clb_model_hparams(self.m).n_embd)):
                raise InputError(f"hidden must be a float32 array of shape ({n}, "
                                 f"{clb_model_hparams(self.m).n_embd})")
            hv = hidden
            if n > 0:
                hp_x = &hv[0, 0]
            if il1 != clb_model_hparams(self.m).n_layer:
                n_out = 0
        out = np.empty((n_out, V), dtype=np.float32)
        cdef float[:, ::1] lo = out
        cdef clb_batch b
        b.n_tokens = n
        b.tokens = &tk[0] if n > 0 else NULL
        b.seq_ids = &sq[0] if n > 0 else NULL
        b.positions = &ps[0] if n > 0 else NULL
        b.want_logits = wp
        b.n_seq = <int32_t>tb.shape[0]
        b.max_blocks = <int32_t>tb.shape[1]
        b.block_tables = &tb[0, 0]
        b.routes = NULL
        b.state_slots = NULL
        b.win_tables = NULL
        cdef const int32_t[:, ::1] wt
        if win_tables is not None:
            wt = _as_tables(win_tables, "win_tables")
            if wt.shape[0] != tb.shape[0] or wt.shape[1] != tb.shape[1]:
                raise InputError(f"win_tables shape ({wt.shape[0]}, {wt.shape[1]}) differs from "
                                 f"block_tables' ({tb.shape[0]}, {tb.shape[1]})")
            b.win_tables = &wt[0, 0]
        b.hidden_in = NULL
        b.hidden_out = NULL
        b.hidden_out_normed = 1 if hidden_normed else 0
        cdef int64_t D = clb_model_hparams(self.m).n_embd
        cdef const float[:, ::1] hiv
        cdef float[:, ::1] hov
        if hidden_in is not None:
            if (not isinstance(hidden_in, np.ndarray) or hidden_in.dtype != np.float32
                    or hidden_in.shape != (n, D)):
                raise InputError(f"hidden_in must be a float32 array of shape ({n}, {D})")
            hiv = np.ascontiguousarray(hidden_in)
            if n > 0:
                b.hidden_in = &hiv[0, 0]
        elif clb_model_hparams(self.m).mtp_input:
            raise InputError("a multi-token-prediction layer needs hidden_in")
        if hidden_out is not None:
            if (not isinstance(hidden_out, np.ndarray) or hidden_out.dtype != np.float32
                    or hidden_out.shape != (n, D) or not hidden_out.flags.c_contiguous):
                raise InputError(f"hidden_out must be a C-contiguous float32 array of shape "
                                 f"({n}, {D})")
            hov = hidden_out
            if n > 0:
                b.hidden_out = &hov[0, 0]
        cdef int32_t[::1] sl
        if state_slots is not None:
            sl = _as_i32(state_slots, "state_slots")
            if sl.shape[0] != tb.shape[0]:
                raise InputError(f"state_slots has {sl.shape[0]} entries for {tb.shape[0]} "
                                 f"sequences")
            b.state_slots = &sl[0]
        cdef int32_t[:, :, ::1] rv
        if routes is not None:
            hp = clb_model_hparams(self.m)
            if (not isinstance(routes, np.ndarray) or routes.dtype != np.int32
                    or routes.shape != (n, hp.n_layer, hp.n_expert_used)):
                raise InputError(f"routes must be an int32 array of shape ({n}, {hp.n_layer}, "
                                 f"{hp.n_expert_used})")
            rv = routes
            if n > 0:
                b.routes = &rv[0, 0, 0]
        cdef float *lp = &lo[0, 0] if n_out > 0 else NULL
        cdef char err[512]
        cdef clb_status st
        err[0] = 0
        with self._lock:
            with nogil:
                if span is None:
                    st = clb_forward(self.m, kv.kv, &b, lp, err)
                else:
                    st = clb_forward_span(self.m, kv.kv, &b, il0, il1, hp_x, lp, err)
        if st != CLB_OK:
            raise _status_error(st, err)
        return out
