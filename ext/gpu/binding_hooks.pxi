# Testing hooks over the GPU kernels (ext/gpu/ds4_gpu.h, matvec_fused.h), for ext/python/_native.pyx to include:
#
#     include "../gpu/binding_hooks.pxi"        (after _weight_type and _as_bytes are defined)
#
# whose _testing namespace takes the gpu_* hooks listed in _GPU_TESTING at the end of this file
# (tests/gpu/test_gpu_kernels.py uses them). "../gpu/ds4_gpu.h" resolves through the ext/include
# include path in every build; without a GPU backend the header's inline stand-ins raise
# RuntimeError, so the same binding builds with DS4_GPU=off, cuda and hip. Each hook validates
# its arrays, releases the GIL, and runs synchronously on host copies.

from libcpp cimport bool as cbool

cdef extern from "../gpu/ds4_gpu.h" namespace "ds4::gpu::testing" nogil:
    void gpu_matvec "ds4::gpu::testing::matvec"(const TensorView& W, const float* X, int ncols, int64_t ldx,
                                                float* Y, int64_t ldy, cbool tall, int staged_min) except +
    void gpu_matvec_grouped "ds4::gpu::testing::matvec_grouped"(
        const TensorView& W, const float* X, int64_t x_rows, int64_t ldx, const int32_t* pair_expert,
        const int32_t* x_row, int n_pairs, int max_part, float* Y, int64_t ldy, int max_cols) except +
    void gpu_set_matvec_chunked "ds4::gpu::testing::set_matvec_chunked"(cbool on) except +
    void gpu_set_matvec_persistent "ds4::gpu::testing::set_matvec_persistent"(cbool on) except +
    void gpu_set_matvec_tall_stages "ds4::gpu::testing::set_matvec_tall_stages"(int stages) except +
    int64_t gpu_set_matvec_tall_min_k "ds4::gpu::testing::set_matvec_tall_min_k"(int64_t k) except +
    int64_t gpu_set_matvec_staged_min_rows "ds4::gpu::testing::set_matvec_staged_min_rows"(int64_t rows) except +
    void gpu_set_matvec_grouped "ds4::gpu::testing::set_matvec_grouped"(int variant, int stages, int width) except +
    int gpu_set_matvec_grouped_groups "ds4::gpu::testing::set_matvec_grouped_groups"(int groups) except +
    int gpu_set_attn_heads "ds4::gpu::testing::set_attn_heads"(int heads) except +
    int gpu_set_attn_split_min "ds4::gpu::testing::set_attn_split_min"(int keys) except +
    int gpu_set_hc_site_streams "ds4::gpu::testing::set_hc_site_streams"(int streams) except +
    cbool gpu_attn_early "ds4::gpu::testing::attn_early"() except +
    void gpu_matvec_batched "ds4::gpu::testing::matvec_batched"(const TensorView& W, int n_batch, const float* X,
                                                                int ncols, float* Y, cbool tall,
                                                                int staged_min) except +
    void gpu_rms_norm "ds4::gpu::testing::rms_norm"(const float* X, const float* w, float* Y, int n_rows,
                                                    int64_t n, float eps) except +
    void gpu_embed_rows "ds4::gpu::testing::embed_rows"(const TensorView& E, const int32_t* tokens, int n,
                                                        float* Y) except +
    void gpu_rope_tail "ds4::gpu::testing::rope_tail"(float* X, int n_rows, int n_heads, int head_dim,
                                                      int rope_dim, const int32_t* pos, const double* inv_freq,
                                                      cbool inverse) except +
    void gpu_attention_sink "ds4::gpu::testing::attention_sink"(
        const float* q, const uint16_t* kv, int64_t kv_rows, const int32_t* key_rows, const int32_t* key_off,
        int n_lanes, int n_head, int head_dim, const float* sinks, float* out) except +
    void gpu_argmax_rows "ds4::gpu::testing::argmax_rows"(const float* X, int n_rows, int64_t n,
                                                          int32_t* out) except +
    void gpu_route "ds4::gpu::testing::route"(const float* logits, int n, int n_expert, int k, const float* bias,
                                              cbool norm, float scale, int32_t* ids, float* weights) except +
    int gpu_expert_parts "ds4::gpu::testing::expert_parts"(const int32_t* pair_expert, int n_pairs, int n_expert,
                                                         int max_part, int32_t* sorted, int32_t* parts) except +
    cbool gpu_router_route "ds4::gpu::testing::router_route"(
        const TensorView& W, const float* X, int n, const int32_t* tid2eid, int64_t n_vocab, const int32_t* tokens,
        const float* bias, int k, cbool norm, float scale, int max_part, int repeat, float* logits, int32_t* ids,
        float* weights, int32_t* sorted, int32_t* parts, int32_t* n_parts) except +
    void gpu_hc_site "ds4::gpu::testing::hc_site"(float* X, int n, int64_t d, const float* Y, float* post, float* comb,
                                                  const TensorView& fn, const float* scale, const float* base,
                                                  int iters, float hc_eps, float norm_eps, const float* norm_w,
                                                  float* U) except +


cdef extern from "../gpu/matvec_fused.h" namespace "ds4::gpu::testing" nogil:
    int gpu_matvec_multi "ds4::gpu::testing::matvec_multi"(const TensorView* W, int n, const float* X, int ncols,
                                                           float* const* Y, cbool tall, int staged_min) except +
    cbool gpu_matvec_grouped_pair "ds4::gpu::testing::matvec_grouped_pair"(
        const TensorView& Wg, const TensorView& Wu, const float* X, int64_t x_rows, const int32_t* pair_expert,
        const int32_t* x_row, int n_pairs, int max_part, float* G, float* U, cbool swiglu, float swiglu_limit,
        int max_cols) except +
    void gpu_swiglu "ds4::gpu::testing::swiglu"(float* G, const float* U, int rows, int64_t width,
                                                float limit) except +
    void gpu_set_matvec_fuse "ds4::gpu::testing::set_matvec_fuse"(cbool on) except +
    cbool gpu_set_matvec_mma "ds4::gpu::testing::set_matvec_mma"(cbool on) except +
    cbool gpu_set_pdl "ds4::gpu::testing::set_pdl"(cbool on) except +
    cbool gpu_set_matvec_int8 "ds4::gpu::testing::set_matvec_int8"(cbool on) except +
    int gpu_set_matvec_imma "ds4::gpu::testing::set_matvec_imma"(int min_cols) except +
    int gpu_set_matvec_imma_grouped "ds4::gpu::testing::set_matvec_imma_grouped"(int min_pairs) except +
    int gpu_set_matvec_imma_narrow "ds4::gpu::testing::set_matvec_imma_narrow"(int min_rows, int ahead,
                                                                               int persist) except +
    int gpu_set_matvec_imma_indep "ds4::gpu::testing::set_matvec_imma_indep"(int mask) except +
    int64_t gpu_imma_launches "ds4::gpu::testing::imma_launches"(int path) except +
    cbool gpu_set_planes_fused "ds4::gpu::testing::set_planes_fused"(cbool on) except +
    int64_t gpu_planes_prep_launches "ds4::gpu::testing::planes_prep_launches"() except +


cdef TensorView _weights_view(int ggml_type, raw, int64_t ne0, int64_t ne1, int64_t ne2, object keep) except *:
    cdef DType t = _weight_type(ggml_type)
    if ne0 <= 0 or ne1 <= 0 or ne2 <= 0 or ne0 % block_elems(t):
        raise ValueError(f"bad weight shape ({ne0}, {ne1}, {ne2}) for {dtype_name(t).decode()}")
    data = _as_bytes(raw)
    if data.shape[0] < ne0 // block_elems(t) * block_bytes(t) * ne1 * ne2:
        raise ValueError("raw data is shorter than the weight tensor")
    keep.append(data)
    cdef const uint8_t[::1] src = data
    cdef TensorView W
    W.type = t
    W.ne[0] = ne0
    W.ne[1] = ne1
    W.ne[2] = ne2
    W.ne[3] = 1
    W.data = &src[0]
    return W


def _t_gpu_matmul(int ggml_type, raw, int64_t ne0, int64_t ne1, X, tall=False, staged=None):
    """_t_matmul on the GPU (ds4::gpu::testing::matvec); tall: the tall-matrix variant; staged: None
    for matvec's default (the staged kernel from 2 columns), False never, True from 1 column (each
    where the shape qualifies: >= 512 rows, not F32)."""
    keep = []
    cdef TensorView W = _weights_view(ggml_type, raw, ne0, ne1, 1, keep)
    x = np.ascontiguousarray(X, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != ne0:
        raise ValueError(f"X must be [ncols, {ne0}]")
    cdef int ncols = x.shape[0]
    y = np.zeros((ncols, ne1), dtype=np.float32)
    if ncols == 0:
        return y
    cdef const float[:, ::1] xv = x
    cdef float[:, ::1] yv = y
    cdef cbool t = bool(tall)
    cdef int staged_min = 2 if staged is None else (1 if staged else 1 << 30)
    with nogil:
        gpu_matvec(W, &xv[0, 0], ncols, ne0, &yv[0, 0], ne1, t, staged_min)
    return y


def _t_gpu_matmul_grouped(int ggml_type, raw, int64_t ne0, int64_t ne1, int64_t n_expert, X, pair_expert, x_row,
                          int max_part, int max_cols=8):
    """Y[p] = W[pair_expert[p]] . X[x_row[p]] through the device planner and the grouped kernel
    (max_cols: the widest piece of a part the kernel runs at once; the bits never depend on it)."""
    keep = []
    cdef TensorView W = _weights_view(ggml_type, raw, ne0, ne1, n_expert, keep)
    x = np.ascontiguousarray(X, dtype=np.float32)
    pe = np.ascontiguousarray(pair_expert, dtype=np.int32)
    xr = np.ascontiguousarray(x_row, dtype=np.int32)
    if x.ndim != 2 or x.shape[1] != ne0 or x.shape[0] == 0 or pe.shape != xr.shape or pe.ndim != 1:
        raise ValueError("X must be [rows, ne0]; pair_expert and x_row the same length")
    cdef int n_pairs = pe.shape[0]
    y = np.zeros((n_pairs, ne1), dtype=np.float32)
    if n_pairs == 0:
        return y
    cdef const float[:, ::1] xv = x
    cdef const int32_t[::1] pev = pe
    cdef const int32_t[::1] xrv = xr
    cdef float[:, ::1] yv = y
    cdef int64_t x_rows = x.shape[0]
    with nogil:
        gpu_matvec_grouped(W, &xv[0, 0], x_rows, ne0, &pev[0], &xrv[0], n_pairs, max_part, &yv[0, 0], ne1,
                           max_cols)
    return y


def _t_gpu_matmul_batched(int ggml_type, raw, int64_t ne0, int64_t ne1, int n_batch, X, tall=False, staged=None):
    """n_batch equal products in one launch: W [ne1 rows of ne0] cut into n_batch row groups, X
    [ncols, n_batch * ne0] (group i reads its columns' elements [i * ne0, (i + 1) * ne0)); returns
    [ncols, ne1] in group order. staged as in _t_gpu_matmul."""
    keep = []
    cdef TensorView W = _weights_view(ggml_type, raw, ne0, ne1, 1, keep)
    x = np.ascontiguousarray(X, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != ne0 * n_batch or n_batch < 1 or ne1 % n_batch:
        raise ValueError(f"X must be [ncols, {ne0 * n_batch}] and {ne1} rows must split into {n_batch}")
    cdef int ncols = x.shape[0]
    y = np.zeros((ncols, ne1), dtype=np.float32)
    if ncols == 0:
        return y
    cdef const float[:, ::1] xv = x
    cdef float[:, ::1] yv = y
    cdef cbool t = bool(tall)
    cdef int staged_min = 2 if staged is None else (1 if staged else 1 << 30)
    with nogil:
        gpu_matvec_batched(W, n_batch, &xv[0, 0], ncols, &yv[0, 0], t, staged_min)
    return y


def _t_gpu_matmul_multi(products, int64_t ne0, X, tall=False, staged=None):
    """matvec_multi (ext/gpu/matvec_fused.h) on the GPU: products [(ggml_type, raw, ne1), ...] (at most
    8) all read X [ncols, ne0]; returns ([Y_i [ncols, ne1_i]], the kernel launches it made). tall
    and staged as in _t_gpu_matmul."""
    keep = []
    cdef int n = len(products)
    if n < 1 or n > 8:
        raise ValueError("matvec_multi takes 1..8 products")
    x = np.ascontiguousarray(X, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != ne0:
        raise ValueError(f"X must be [ncols, {ne0}]")
    cdef int ncols = x.shape[0]
    cdef vector[TensorView] ws
    cdef vector[float*] ys
    cdef float[:, ::1] yv
    outs = []
    for t, raw, ne1 in products:
        ws.push_back(_weights_view(t, raw, ne0, ne1, 1, keep))
        y = np.zeros((max(ncols, 1), ne1), dtype=np.float32)
        yv = y
        ys.push_back(&yv[0, 0])
        outs.append(y[:ncols])
    if ncols == 0:
        return outs, 0
    cdef const float[:, ::1] xv = x
    cdef cbool tl = bool(tall)
    cdef int staged_min = 2 if staged is None else (1 if staged else 1 << 30)
    cdef int launches
    with nogil:
        launches = gpu_matvec_multi(ws.data(), n, &xv[0, 0], ncols, ys.data(), tl, staged_min)
    return outs, launches


def _t_gpu_matmul_grouped_pair(int ggml_type, raw_gate, raw_up, int64_t ne0, int64_t ne1, int64_t n_expert, X,
                               pair_expert, x_row, int max_part, int max_cols=8, swiglu_limit=None):
    """The routed experts' gate and up products in one launch (matvec_grouped_pair) over the device
    planner's parts, as _t_gpu_matmul_grouped takes them. swiglu_limit None: returns (G, U, fused);
    a float: returns (swiglu(G, U) with that clamp, None, fused). fused: whether the one-launch kernel
    ran (where it declines, the separate launches gave the outputs)."""
    keep = []
    cdef TensorView Wg = _weights_view(ggml_type, raw_gate, ne0, ne1, n_expert, keep)
    cdef TensorView Wu = _weights_view(ggml_type, raw_up, ne0, ne1, n_expert, keep)
    x = np.ascontiguousarray(X, dtype=np.float32)
    pe = np.ascontiguousarray(pair_expert, dtype=np.int32)
    xr = np.ascontiguousarray(x_row, dtype=np.int32)
    if x.ndim != 2 or x.shape[1] != ne0 or x.shape[0] == 0 or pe.shape != xr.shape or pe.ndim != 1 or pe.shape[0] == 0:
        raise ValueError("X must be [rows, ne0]; pair_expert and x_row the same, non-zero length")
    cdef int n_pairs = pe.shape[0]
    g = np.zeros((n_pairs, ne1), dtype=np.float32)
    u = np.zeros((n_pairs, ne1), dtype=np.float32)
    cdef const float[:, ::1] xv = x
    cdef const int32_t[::1] pev = pe
    cdef const int32_t[::1] xrv = xr
    cdef float[:, ::1] gv = g
    cdef float[:, ::1] uv = u
    cdef int64_t x_rows = x.shape[0]
    cdef cbool sw = swiglu_limit is not None
    cdef float limit = 0.0 if swiglu_limit is None else swiglu_limit
    cdef cbool fused
    with nogil:
        fused = gpu_matvec_grouped_pair(Wg, Wu, &xv[0, 0], x_rows, &pev[0], &xrv[0], n_pairs, max_part, &gv[0, 0],
                                        &uv[0, 0], sw, limit, max_cols)
    return g, (None if sw else u), bool(fused)


def _t_gpu_swiglu(G, U, float limit):
    """lane_ops.cu's swiglu kernel on rows G, U [rows, width]: silu(min(G, L)) * clamp(U, -L, L) (no clamp
    for L <= 0); returns a new array."""
    g = np.array(G, dtype=np.float32, order="C", copy=True)
    u = np.ascontiguousarray(U, dtype=np.float32)
    if g.ndim != 2 or g.shape != u.shape:
        raise ValueError("G and U must be [rows, width] of one shape")
    if g.size == 0:
        return g
    cdef float[:, ::1] gv = g
    cdef const float[:, ::1] uv = u
    cdef int rows = g.shape[0]
    cdef int64_t width = g.shape[1]
    with nogil:
        gpu_swiglu(&gv[0, 0], &uv[0, 0], rows, width, limit)
    return g


def _t_gpu_set_matvec_fuse(on):
    """Turn the fused matvec launches (matvec_multi, the grouped gate/up pair) on or off, process-wide
    (the bits never change; DS4_GPU_MV_FUSE=0 is the environment's way)."""
    gpu_set_matvec_fuse(bool(on))


def _t_gpu_set_matvec_mma(on):
    """Send every product whose weights the tensor-core kernels take (Q8_0, Q4_K, F16, BF16 with K a
    multiple of 256) to them, or none, process-wide (DS4_GPU_MMA=1 is the environment's way; the
    bits differ from the fp32 SIMT kernels' in the last places). Returns whether the switch is on
    now: always False in a build without the tensor-core kernels (HIP)."""
    return bool(gpu_set_matvec_mma(bool(on)))


def _t_gpu_set_matvec_int8(on):
    """The integer Q8_0 products (ext/gpu/xplanes.cuh; default on, DS4_GPU_MV_INT8=0 is the
    environment's way to turn them off) or the fp32 decode-and-fma path, process-wide; the two differ
    in the last bits. Returns whether the switch is on now."""
    return bool(gpu_set_matvec_int8(bool(on)))


def _t_gpu_set_matvec_imma(int min_cols):
    """The fewest columns from which a Q8_0 product (integer products on) takes the integer tensor-core
    kernel (ext/gpu/imma_q8.cu; 0: never; -1: back to DS4_GPU_MV_IMMA=N or the default, 6),
    process-wide. The bits never depend on it. Returns the setting now."""
    return int(gpu_set_matvec_imma(min_cols))


def _t_gpu_set_matvec_imma_grouped(int min_pairs):
    """The fewest pairs per expert (pairs / experts of the stack) from which a grouped Q4_K product takes
    the integer tensor-core kernel (ext/gpu/imma_q4k.cu; 0: never; -1: back to
    DS4_GPU_MV_IMMA_GROUPED=N or the default, 2), process-wide. The bits never depend on it. Returns the
    setting now."""
    return int(gpu_set_matvec_imma_grouped(min_pairs))


def _t_gpu_set_matvec_imma_narrow(int min_rows, int ahead, int persist=-1):
    """The tensor-core Q8_0 kernel's narrow tile (calls of at most 8 columns): the fewest rows (times
    batch members) such a call needs to take it (-1: back to DS4_GPU_MV_IMMA_NARROW_ROWS=N or the
    default, 4096; 0: any), whether it loads its planes a chunk ahead and whether a call with more
    row blocks than SMs runs on a persistent grid (each 0/1; -1: back to DS4_GPU_MV_IMMA_AHEAD /
    DS4_GPU_MV_IMMA_PERSIST or the default, on), process-wide. The bits never depend on any of them.
    Returns (min_rows, ahead, persist) now."""
    v = int(gpu_set_matvec_imma_narrow(min_rows, ahead, persist))
    return v // 4, bool(v & 1), bool(v & 2)


def _t_gpu_set_matvec_imma_indep(int mask):
    """Which prompt tiles take a unit's three MMAs independent of each other instead of the second
    chained on the first, process-wide: a mask, 1 the wide Q8_0 tile, 2 the grouped Q4_K kernel, 4 the
    narrow Q8_0 tile (-1: the default, 2). The bits never depend on it. Returns the mask now."""
    return int(gpu_set_matvec_imma_indep(mask))


IMMA_PATHS = ("q8_cp_async", "q8_bulk", "q4k_cp_async", "q4k_bulk")  # imma.h ImmaPath, in order


def _t_gpu_imma_launches(path="all"):
    """Launches of the integer tensor-core kernels so far in this process: all of them, or those on
    one path (IMMA_PATHS: the Q8_0 tiles' weights, and the grouped Q4_K kernel's weights and planes,
    by cp.async or by bulk copies)."""
    if path != "all" and path not in IMMA_PATHS:
        raise ValueError(f"gpu_imma_launches: path must be 'all' or one of {', '.join(IMMA_PATHS)}, not {path!r}")
    return int(gpu_imma_launches(-1 if path == "all" else IMMA_PATHS.index(path)))


def _t_gpu_set_planes_fused(on):
    """Producer-built planes (ext/gpu/matvec_fused.h planes_fused; default on, DS4_GPU_PLANES_FUSED=0
    is the environment's way to turn them off): the engine's kernels that write a product's input also
    write its planes, so the product launches no prep. The same bits either way. Returns whether it
    is on now."""
    return bool(gpu_set_planes_fused(bool(on)))


def _t_gpu_planes_prep_launches():
    """Launches of the planes prep kernel (ext/gpu/xplanes.cuh) so far in this process."""
    return int(gpu_planes_prep_launches())


def _t_gpu_set_pdl(on):
    """Launch the engine's kernels with programmatic dependent launch (ext/gpu/launch.cuh) or without,
    process-wide (the bits never change; DS4_GPU_PDL=0 is the environment's way). Returns whether it
    is on now: False where the device cannot (HIP, compute capability below 9.0)."""
    return bool(gpu_set_pdl(bool(on)))


def _t_gpu_set_matvec_chunked(on):
    """Turn the Q8_0/Q4_K chunked weight loads on or off, process-wide (the bits never change)."""
    gpu_set_matvec_chunked(bool(on))


def _t_gpu_set_matvec_persistent(on):
    """Give the direct matvec kernel its persistent grid (each block several row blocks) or one block a
    row block, process-wide (the bits never change; DS4_GPU_MV_PERSIST=0 is the environment's way)."""
    gpu_set_matvec_persistent(bool(on))


def _t_gpu_set_matvec_tall_stages(int stages):
    """The tall matvec variant's chunk stages for Q8_0 products of up to 4 columns: 1 (default) or 2,
    process-wide (the bits never change; DS4_GPU_MV_TALL_STAGES=2 is the environment's way)."""
    gpu_set_matvec_tall_stages(stages)


def _t_gpu_set_matvec_tall_min_k(int64_t k):
    """The fewest elements a row a matrix needs to take the tall matvec variant (with the engine's tall
    switch on and at least 16384 rows), process-wide: 0 any, -1 back to DS4_GPU_MV_TALL_MIN_K or the
    default, 2048. Returns the value in force (the bits never change)."""
    return int(gpu_set_matvec_tall_min_k(k))


def _t_gpu_set_matvec_staged_min_rows(int64_t rows):
    """The fewest rows a matrix needs to take the staged matvec kernel (its columns in shared memory;
    with at least the engine's staged_min_cols columns) at every width, process-wide: 1 or more, -1 back
    to the rule (512 rows, 256 for whole 16-column chunks). Returns the setting now, 0 for the rule (the
    bits never change)."""
    return int(gpu_set_matvec_staged_min_rows(rows))


def _t_gpu_set_matvec_grouped(int variant, int stages=0, int width=0):
    """Which grouped kernel Q4_K expert products take, process-wide: 0 pass 5, 1 the own body,
    2 the own body with the one-fma decode; stages 2..4 the own body's copy stages and width 1, 2, 4
    or 8 its widest sub-part (each 0: keep, -1: back to DS4_GPU_MV_GROUPED_STAGES / _WIDTH or the
    default, 3 and 4) (ext/gpu/matvec.cuh; the bits never change)."""
    gpu_set_matvec_grouped(variant, stages, width)


def _t_gpu_set_matvec_grouped_groups(int groups):
    """The own grouped kernel's row groups a warp streams in one copy stream, process-wide (1..16;
    0: chosen per launch; -1: back to DS4_GPU_MV_GROUPED_GROUPS=N, else 0); the bits never change.
    Returns the setting now."""
    return int(gpu_set_matvec_grouped_groups(groups))


def _t_gpu_set_attn_heads(int heads):
    """Heads a block of the split attention, process-wide: 1, 2 or 4, or -1 for the rule (two for one
    or two lanes, else four). The bits never change. Returns the setting now (0: the rule)."""
    return int(gpu_set_attn_heads(heads))


def _t_gpu_set_attn_split_min(int keys):
    """The fewest keys a split of the attention, process-wide: 8 to 256 in steps of 8, or -1 for the
    default (64). It changes the bits, alike in decode and prompt steps, so every contract holds within
    one setting. Returns the setting now."""
    return int(gpu_set_attn_split_min(keys))


def _t_gpu_set_hc_site_streams(int streams):
    """The mHC site's streams a sums thread, process-wide: 1 or 2, or -1 for the default (2). It changes
    the bits, alike in decode and prompt steps, so every contract holds within one setting. Returns the
    setting now."""
    return int(gpu_set_hc_site_streams(streams))


def _t_gpu_attn_early():
    """Whether the attention's split and combine kernels do their step-input work before the grid
    wait in this process (DS4_GPU_ATTN_EARLY, read once a process; default on)."""
    return bool(gpu_attn_early())


def _t_gpu_rms_norm(X, w, float eps):
    """RMSNorm of each row of X (w None: unweighted) on the GPU."""
    x = np.ascontiguousarray(X, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError("X must be a non-empty [rows, n]")
    y = np.empty_like(x)
    wa = None if w is None else np.ascontiguousarray(w, dtype=np.float32)
    if wa is not None and wa.shape != (x.shape[1],):
        raise ValueError("w must have n elements")
    cdef const float[:, ::1] xv = x
    cdef float[:, ::1] yv = y
    cdef const float[::1] wv
    cdef const float* wp = NULL
    if wa is not None:
        wv = wa
        wp = &wv[0]
    cdef int rows = x.shape[0]
    cdef int64_t n = x.shape[1]
    with nogil:
        gpu_rms_norm(&xv[0, 0], wp, &yv[0, 0], rows, n, eps)
    return y


def _t_gpu_embed(int ggml_type, raw, int64_t ne0, int64_t ne1, tokens):
    """Rows `tokens` of a [ne1, ne0] table, dequantized on the GPU."""
    keep = []
    cdef TensorView E = _weights_view(ggml_type, raw, ne0, ne1, 1, keep)
    tok = np.ascontiguousarray(tokens, dtype=np.int32)
    cdef int n = tok.shape[0]
    y = np.zeros((n, ne0), dtype=np.float32)
    if n == 0:
        return y
    cdef const int32_t[::1] tv = tok
    cdef float[:, ::1] yv = y
    with nogil:
        gpu_embed_rows(E, &tv[0], n, &yv[0, 0])
    return y


def _t_gpu_rope_tail(X, int rope_dim, pos, inv_freq, bint inverse):
    """Tail RoPE of X [rows, heads, head_dim] at pos[rows] on the GPU; returns a new array."""
    x = np.array(X, dtype=np.float32, order="C", copy=True)
    p = np.ascontiguousarray(pos, dtype=np.int32)
    f = np.ascontiguousarray(inv_freq, dtype=np.float64)
    if x.ndim != 3 or p.shape != (x.shape[0],) or f.shape != (rope_dim // 2,):
        raise ValueError("X [rows, heads, head_dim], pos [rows], inv_freq [rope_dim / 2]")
    if x.shape[0] == 0:
        return x
    cdef float[:, :, ::1] xv = x
    cdef const int32_t[::1] pv = p
    cdef const double[::1] fv = f
    cdef int rows = x.shape[0], heads = x.shape[1], head_dim = x.shape[2]
    with nogil:
        gpu_rope_tail(&xv[0, 0, 0], rows, heads, head_dim, rope_dim, &pv[0], &fv[0], inverse)
    return x


def _t_gpu_attention_sink(q, kv, key_rows, key_off, sinks):
    """Sink-column attention of q [lanes, heads, dim] over f16 rows kv [rows, dim] on the GPU."""
    qa = np.ascontiguousarray(q, dtype=np.float32)
    kva = np.ascontiguousarray(kv, dtype=np.float16)
    kr = np.ascontiguousarray(key_rows, dtype=np.int32)
    ko = np.ascontiguousarray(key_off, dtype=np.int32)
    sa = np.ascontiguousarray(sinks, dtype=np.float32)
    if qa.ndim != 3 or kva.ndim != 2 or kva.shape[1] != qa.shape[2] or ko.shape != (qa.shape[0] + 1,) \
            or sa.shape != (qa.shape[1],) or kva.shape[0] == 0:
        raise ValueError("q [lanes, heads, dim], kv [rows, dim], key_off [lanes + 1], sinks [heads]")
    out = np.zeros_like(qa)
    if qa.shape[0] == 0:
        return out
    kr1 = kr if kr.shape[0] else np.zeros(1, np.int32)
    cdef const float[:, :, ::1] qv = qa
    cdef const uint16_t[:, ::1] kvv = kva.view(np.uint16)
    cdef const int32_t[::1] krv = kr1
    cdef const int32_t[::1] kov = ko
    cdef const float[::1] sv = sa
    cdef float[:, :, ::1] ov = out
    cdef int lanes = qa.shape[0], heads = qa.shape[1], dim = qa.shape[2]
    cdef int64_t rows = kva.shape[0]
    with nogil:
        gpu_attention_sink(&qv[0, 0, 0], &kvv[0, 0], rows, &krv[0], &kov[0], lanes, heads, dim, &sv[0],
                           &ov[0, 0, 0])
    return out


def _t_gpu_route(logits, bias, int k, norm=True, float scale=1.0):
    """The biased top-k router on the GPU (not hash-routed): logits [n, n_expert], bias [n_expert];
    returns (ids int32 [n, k] in selection order, weights float32 [n, k])."""
    lg = np.ascontiguousarray(logits, dtype=np.float32)
    b = np.ascontiguousarray(bias, dtype=np.float32)
    if lg.ndim != 2 or b.shape != (lg.shape[1],) or lg.shape[0] == 0:
        raise ValueError("logits must be [n, n_expert] and bias [n_expert]")
    ids = np.zeros((lg.shape[0], k), dtype=np.int32)
    w = np.zeros((lg.shape[0], k), dtype=np.float32)
    cdef const float[:, ::1] lv = lg
    cdef const float[::1] bv = b
    cdef int32_t[:, ::1] iv = ids
    cdef float[:, ::1] wv = w
    cdef int n = lg.shape[0], e = lg.shape[1]
    cdef cbool nm = bool(norm)
    with nogil:
        gpu_route(&lv[0, 0], n, e, k, &bv[0], nm, scale, &iv[0, 0], &wv[0, 0])
    return ids, w


def _t_gpu_expert_parts(pair_expert, int n_expert, int max_part=8):
    """build_expert_parts (ext/gpu/ds4_gpu.h) on pair_expert [n_pairs]: returns (sorted [n_pairs], -1
    past the valid pairs; parts [n_parts, 3] of (expert, first, count))."""
    pe = np.ascontiguousarray(pair_expert, dtype=np.int32).reshape(-1)
    if pe.shape[0] == 0:
        raise ValueError("pair_expert must hold at least one pair")
    cdef int n = pe.shape[0]
    so = np.zeros(n, dtype=np.int32)
    parts = np.zeros((n, 3), dtype=np.int32)
    cdef const int32_t[::1] pv = pe
    cdef int32_t[::1] sv = so
    cdef int32_t[:, ::1] av = parts
    cdef int count
    with nogil:
        count = gpu_expert_parts(&pv[0], n, n_expert, max_part, &sv[0], &av[0, 0])
    return so, parts[:count]


def _t_gpu_router_route(int w_type, w_raw, X, bias, int k, tokens, tid2eid=None, norm=True, float scale=1.0,
                        int max_part=8, int repeat=1):
    """The fused router (ext/gpu/ds4_gpu.h router_route): w_raw the [d, E] router's bytes of ggml type
    w_type, X [n, d], bias [E], tokens [n]; tid2eid [n_vocab, k] for a hash layer. Returns (logits
    [n, E], ids [n, k], weights [n, k], sorted [n k], parts [n_parts, 3]) after `repeat` launches, or
    None where the fused router does not take the shape."""
    x = np.ascontiguousarray(X, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError("X must be [n, d] with n > 0")
    cdef int n = x.shape[0]
    cdef int64_t d = x.shape[1]
    b = np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
    cdef int64_t e = b.shape[0]
    tk = np.ascontiguousarray(tokens, dtype=np.int32).reshape(n)
    keep = []
    cdef TensorView W = _weights_view(w_type, w_raw, d, e, 1, keep)
    t2 = None if tid2eid is None else np.ascontiguousarray(tid2eid, dtype=np.int32)
    if t2 is not None and (t2.ndim != 2 or t2.shape[1] != k or int(tk.min()) < 0 or int(tk.max()) >= t2.shape[0]):
        raise ValueError("tid2eid must be [n_vocab, k] and the tokens below n_vocab")
    logits = np.zeros((n, e), dtype=np.float32)
    ids = np.zeros((n, k), dtype=np.int32)
    w = np.zeros((n, k), dtype=np.float32)
    so = np.zeros(n * k, dtype=np.int32)
    parts = np.zeros((n * k, 3), dtype=np.int32)
    n_parts = np.zeros(1, dtype=np.int32)
    cdef const float[:, ::1] xv = x
    cdef const float[::1] bv = b
    cdef const int32_t[::1] tv = tk
    cdef const int32_t[:, ::1] t2v
    cdef const int32_t* t2p = NULL
    cdef int64_t n_vocab = 0
    if t2 is not None:
        t2v = t2
        t2p = &t2v[0, 0]
        n_vocab = t2.shape[0]
    cdef float[:, ::1] lv = logits
    cdef int32_t[:, ::1] iv = ids
    cdef float[:, ::1] wv = w
    cdef int32_t[::1] sv = so
    cdef int32_t[:, ::1] pv = parts
    cdef int32_t[::1] npv = n_parts
    cdef cbool nm = bool(norm)
    cdef cbool took
    with nogil:
        took = gpu_router_route(W, &xv[0, 0], n, t2p, n_vocab, &tv[0], &bv[0], k, nm, scale, max_part, repeat,
                                &lv[0, 0], &iv[0, 0], &wv[0, 0], &sv[0], &pv[0, 0], &npv[0])
    if not took:
        return None
    return logits, ids, w, so, parts[: int(n_parts[0])]


def _t_gpu_hc_site(X, Y, post, comb, int fn_type, fn_raw, scale, base, int iters, float hc_eps, float norm_eps,
                   norm_w=None):
    """One fused mHC site (ext/gpu/step_ops.h hc_site, then hc_comb): X [n, 4, d]; Y [n, d] or None (no
    post before the site; then post and comb are not read); post [n, 4], comb [n, 4, 4] of the
    previous site; fn_raw the [24, 4 d] projection's bytes of ggml type fn_type; returns (X after
    the post, U, post, comb) of this site, U normed by norm_w when given."""
    x = np.array(X, dtype=np.float32, order="C", copy=True)
    if x.ndim != 3 or x.shape[1] != 4 or x.shape[0] == 0:
        raise ValueError("X must be [n, 4, d] with n > 0")
    cdef int n = x.shape[0]
    cdef int64_t d = x.shape[2]
    keep = []
    cdef TensorView W = _weights_view(fn_type, fn_raw, 4 * d, 24, 1, keep)
    po = np.array(post, dtype=np.float32, order="C", copy=True).reshape(n, 4)
    co = np.array(comb, dtype=np.float32, order="C", copy=True).reshape(n, 4, 4)
    sc = np.ascontiguousarray(scale, dtype=np.float32).reshape(3)
    ba = np.ascontiguousarray(base, dtype=np.float32).reshape(24)
    y = None if Y is None else np.ascontiguousarray(Y, dtype=np.float32).reshape(n, d)
    nw = None if norm_w is None else np.ascontiguousarray(norm_w, dtype=np.float32).reshape(d)
    u = np.zeros((n, d), dtype=np.float32)
    cdef float[:, :, ::1] xv = x
    cdef float[:, ::1] pv = po
    cdef float[:, :, ::1] cv = co
    cdef const float[::1] scv = sc
    cdef const float[::1] bav = ba
    cdef float[:, ::1] uv = u
    cdef const float[:, ::1] yv
    cdef const float[::1] nwv
    cdef const float* yp = NULL
    cdef const float* nwp = NULL
    if y is not None:
        yv = y
        yp = &yv[0, 0]
    if nw is not None:
        nwv = nw
        nwp = &nwv[0]
    with nogil:
        gpu_hc_site(&xv[0, 0, 0], n, d, yp, &pv[0, 0], &cv[0, 0, 0], W, &scv[0], &bav[0], iters, hc_eps, norm_eps,
                    nwp, &uv[0, 0])
    return x, u, po, co


def _t_gpu_argmax(X):
    """Index of each row's maximum (first on ties, NaN largest) on the GPU."""
    x = np.ascontiguousarray(X, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError("X must be [rows, n] with n > 0")
    out = np.zeros(x.shape[0], dtype=np.int32)
    if x.shape[0] == 0:
        return out
    cdef const float[:, ::1] xv = x
    cdef int32_t[::1] ov = out
    cdef int rows = x.shape[0]
    cdef int64_t n = x.shape[1]
    with nogil:
        gpu_argmax_rows(&xv[0, 0], rows, n, &ov[0])
    return out


# The names _native.pyx adds to its _testing namespace (vars(_testing).update(_GPU_TESTING));
# engine_binding.pxi adds its own.
_GPU_TESTING = dict(
    gpu_matmul=_t_gpu_matmul,
    gpu_matmul_grouped=_t_gpu_matmul_grouped,
    gpu_set_matvec_chunked=_t_gpu_set_matvec_chunked,
    gpu_set_matvec_persistent=_t_gpu_set_matvec_persistent,
    gpu_set_matvec_tall_stages=_t_gpu_set_matvec_tall_stages,
    gpu_set_matvec_tall_min_k=_t_gpu_set_matvec_tall_min_k,
    gpu_set_matvec_staged_min_rows=_t_gpu_set_matvec_staged_min_rows,
    gpu_set_matvec_grouped=_t_gpu_set_matvec_grouped,
    gpu_set_matvec_grouped_groups=_t_gpu_set_matvec_grouped_groups,
    gpu_set_attn_heads=_t_gpu_set_attn_heads,
    gpu_set_attn_split_min=_t_gpu_set_attn_split_min,
    gpu_set_hc_site_streams=_t_gpu_set_hc_site_streams,
    gpu_attn_early=_t_gpu_attn_early,
    gpu_matmul_multi=_t_gpu_matmul_multi,
    gpu_matmul_grouped_pair=_t_gpu_matmul_grouped_pair,
    gpu_swiglu=_t_gpu_swiglu,
    gpu_set_matvec_fuse=_t_gpu_set_matvec_fuse,
    gpu_set_matvec_mma=_t_gpu_set_matvec_mma,
    gpu_set_pdl=_t_gpu_set_pdl,
    gpu_set_matvec_int8=_t_gpu_set_matvec_int8,
    gpu_set_matvec_imma=_t_gpu_set_matvec_imma,
    gpu_set_matvec_imma_grouped=_t_gpu_set_matvec_imma_grouped,
    gpu_set_matvec_imma_narrow=_t_gpu_set_matvec_imma_narrow,
    gpu_set_matvec_imma_indep=_t_gpu_set_matvec_imma_indep,
    gpu_imma_launches=_t_gpu_imma_launches,
    gpu_set_planes_fused=_t_gpu_set_planes_fused,
    gpu_planes_prep_launches=_t_gpu_planes_prep_launches,
    gpu_matmul_batched=_t_gpu_matmul_batched,
    gpu_rms_norm=_t_gpu_rms_norm,
    gpu_embed=_t_gpu_embed,
    gpu_rope_tail=_t_gpu_rope_tail,
    gpu_attention_sink=_t_gpu_attention_sink,
    gpu_argmax=_t_gpu_argmax,
    gpu_route=_t_gpu_route,
    gpu_hc_site=_t_gpu_hc_site,
    gpu_router_route=_t_gpu_router_route,
    gpu_expert_parts=_t_gpu_expert_parts,
)
