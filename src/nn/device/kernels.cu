// carve's device kernels: every operation of a training step but the matrix products
// (cuBLAS runs those). Compiled once per process by NVRTC (src/nn/device/cuda.rs), and in
// CI without a GPU, so that a kernel that does not compile fails there.
//
// Arrays are f32, row-major, at device addresses the step's workspaces hand out. Each
// kernel computes what the host function its comment names computes, with the same
// formulas. The bits are not the host's: reductions along a row are trees over a block's
// threads, and expf/tanhf are not the host's fast_exp/fast_tanh. They are the same bits
// every run: no atomics decide a value (sums across rows run in row order, one thread per
// sum; the update's status takes the first bad element whatever the order).

typedef unsigned long long u64;
typedef unsigned int u32;

// The smallest normal f32: moments below it are stored as 0 (simd::flush).
#define CARVE_MIN_NORMAL 1.17549435e-38f

__device__ __forceinline__ u64 carve_index() {
    return (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x;
}

__device__ __forceinline__ u64 carve_stride() {
    return (u64)gridDim.x * (u64)blockDim.x;
}

__device__ __forceinline__ float carve_flush(float x) {
    return fabsf(x) < CARVE_MIN_NORMAL ? 0.0f : x;
}

__device__ __forceinline__ bool carve_finite(float x) {
    return isfinite(x);
}

struct CarveAdd {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

struct CarveMax {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// `v` of the block's threads (BLOCK threads, a power of two) combined by `op` in a
// tree, through `part`: every thread gets the result.
template <typename Op>
__device__ __forceinline__ float carve_block_reduce(float v, float* part, Op op) {
    u32 t = threadIdx.x;
    part[t] = v;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            part[t] = op(part[t], part[t + s]);
        }
        __syncthreads();
    }
    float out = part[0];
    __syncthreads();
    return out;
}

// The sum of `v` over the block's threads.
__device__ __forceinline__ float carve_block_sum(float v, float* part) {
    return carve_block_reduce(v, part, CarveAdd());
}

// The largest of `v` over the block's threads.
__device__ __forceinline__ float carve_block_max(float v, float* part) {
    return carve_block_reduce(v, part, CarveMax());
}

// out[r, c] = bias[c] (vector::rows_new): a dense layer's output before its product.
extern "C" __global__ void carve_bias_rows(const float* __restrict__ bias, float* __restrict__ out, u64 rows, u64 cols) {
    u64 n = rows * cols;
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        out[i] = bias[i % cols];
    }
}

// y = max(x, 0) (Relu::forward_rows).
extern "C" __global__ void carve_relu(const float* __restrict__ x, float* __restrict__ y, u64 n) {
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float v = x[i];
        y[i] = v > 0.0f ? v : 0.0f;
    }
}

// dx = dy where y > 0, else 0 (Relu::backward_rows).
extern "C" __global__ void carve_relu_backward(const float* __restrict__ y, const float* __restrict__ dy,
                                               float* __restrict__ dx, u64 n) {
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
    }
}

// sum[c] = sum over rows r of x[r, c], in row order (vector::sum_rows): a bias gradient.
extern "C" __global__ void carve_sum_rows(const float* __restrict__ x, float* __restrict__ sum, u64 rows, u64 cols) {
    for (u64 c = carve_index(); c < cols; c += carve_stride()) {
        float acc = 0.0f;
        for (u64 r = 0; r < rows; ++r) {
            acc += x[r * cols + c];
        }
        sum[c] = acc;
    }
}

// Softmax and cross-entropy of each row, and the gradient with respect to the logits
// scaled by `scale` (SoftmaxCrossEntropy::loss_sum_and_gradient): one block per row, the
// block's threads striding the classes; the row's loss goes to row_loss[r] (f64), which
// carve_sum_f64 adds in row order.
extern "C" __global__ void carve_softmax_xent(const float* __restrict__ logits, const u32* __restrict__ labels,
                                              float* __restrict__ grad, double* __restrict__ row_loss, u64 rows,
                                              u64 classes, float scale) {
    __shared__ float part[256];
    u64 r = blockIdx.x;
    if (r >= rows) {
        return;
    }
    const float* x = logits + r * classes;
    float* g = grad + r * classes;
    u32 t = threadIdx.x;
    float m = __int_as_float(0xff800000); // -infinity
    for (u64 c = t; c < classes; c += blockDim.x) {
        m = fmaxf(m, x[c]);
    }
    float max = carve_block_max(m, part);
    float sum = 0.0f;
    for (u64 c = t; c < classes; c += blockDim.x) {
        float e = expf(x[c] - max);
        g[c] = e;
        sum += e;
    }
    float inv = 1.0f / carve_block_sum(sum, part);
    u32 label = labels[r];
    // A label beyond the classes (checked before it came) leaves the row's loss NaN.
    if (t == 0) {
        row_loss[r] = __longlong_as_double(0x7ff8000000000000LL);
    }
    __syncthreads();
    for (u64 c = t; c < classes; c += blockDim.x) {
        float p = g[c] * inv;
        if (c == label) {
            row_loss[r] = -log((double)fmaxf(p, 1e-12f));
            g[c] = p * scale - scale;
        } else {
            g[c] = p * scale;
        }
    }
}

// out[0] = the sum of x[0..n] in order (one thread: the loss sum is the same bits every run).
extern "C" __global__ void carve_sum_f64(const double* __restrict__ x, double* __restrict__ out, u64 n) {
    if (carve_index() != 0) {
        return;
    }
    double acc = 0.0;
    for (u64 i = 0; i < n; ++i) {
        acc += x[i];
    }
    out[0] = acc;
}

// One Adam step of one value (simd::adam): the new moments and the update.
__device__ __forceinline__ void carve_adam(float beta1, float beta2, float epsilon, float step, float m, float v,
                                           float g, float* m_new, float* v_new, float* u) {
    *m_new = carve_flush(beta1 * m + (1.0f - beta1) * g);
    *v_new = carve_flush(beta2 * v + (1.0f - beta2) * g * g);
    *u = -step * *m_new / (sqrtf(*v_new) + epsilon);
}

// The finite check of an Adam step, as a reduction: status ends as n - i for the first
// element i whose moment, update or new value would not be finite, 0 when there is none
// (atomicMax of n - i: the first element wins whatever the order threads run in).
extern "C" __global__ void carve_adam_check(const float* __restrict__ w, const float* __restrict__ grad,
                                            const float* __restrict__ m, const float* __restrict__ v, u64 n,
                                            float beta1, float beta2, float epsilon, float step, u32* status,
                                            const float* __restrict__ decay) {
    // `decay` is not read: the check is of the values before the decay, as the host's is.
    (void)decay;
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float m_new, v_new, u;
        carve_adam(beta1, beta2, epsilon, step, m[i], v[i], grad[i], &m_new, &v_new, &u);
        if (!(carve_finite(m_new) && carve_finite(v_new) && carve_finite(u) && carve_finite(w[i] + u))) {
            atomicMax(status, (u32)(n - i));
        }
    }
}

// Stores the Adam step that carve_adam_check found finite; stores nothing when it did not.
// With `decay` (not null: AdamW), each value is first multiplied by its factor.
extern "C" __global__ void carve_adam_commit(float* __restrict__ w, const float* __restrict__ grad,
                                             float* __restrict__ m, float* __restrict__ v, u64 n, float beta1,
                                             float beta2, float epsilon, float step, const u32* status,
                                             const float* __restrict__ decay) {
    if (*status != 0) {
        return;
    }
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float m_new, v_new, u;
        carve_adam(beta1, beta2, epsilon, step, m[i], v[i], grad[i], &m_new, &v_new, &u);
        m[i] = m_new;
        v[i] = v_new;
        float value = decay != 0 ? w[i] * decay[i] : w[i];
        w[i] = value + u;
    }
}

// SGD with momentum (updater::sgd_velocity): the check, as carve_adam_check.
extern "C" __global__ void carve_sgd_check(const float* __restrict__ w, const float* __restrict__ grad,
                                           const float* __restrict__ velocity, u64 n, float learning_rate,
                                           float momentum, u32* status) {
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float u = carve_flush(momentum * velocity[i] - learning_rate * grad[i]);
        if (!(carve_finite(u) && carve_finite(w[i] + u))) {
            atomicMax(status, (u32)(n - i));
        }
    }
}

// Stores the SGD step that carve_sgd_check found finite.
extern "C" __global__ void carve_sgd_commit(float* __restrict__ w, const float* __restrict__ grad,
                                            float* __restrict__ velocity, u64 n, float learning_rate, float momentum,
                                            const u32* status) {
    if (*status != 0) {
        return;
    }
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float u = carve_flush(momentum * velocity[i] - learning_rate * grad[i]);
        velocity[i] = u;
        w[i] += u;
    }
}

// GELU's tanh form (vector::gelu, vector::gelu_slope).
#define CARVE_GELU_C 0.7978846f
#define CARVE_GELU_A 0.044715f

extern "C" __global__ void carve_gelu(const float* __restrict__ x, float* __restrict__ y, u64 n) {
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float v = x[i];
        float u = CARVE_GELU_C * fmaf(CARVE_GELU_A * v * v, v, v);
        float h = 0.5f * v;
        y[i] = fmaf(h, tanhf(u), h);
    }
}

extern "C" __global__ void carve_gelu_backward(const float* __restrict__ x, const float* __restrict__ dy,
                                               float* __restrict__ dx, u64 n) {
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float v = x[i];
        float x2 = v * v;
        float t = tanhf(CARVE_GELU_C * fmaf(CARVE_GELU_A * x2, v, v));
        float sech2 = fmaf(-t, t, 1.0f);
        float inner = fmaf(x2, 3.0f * CARVE_GELU_A, 1.0f);
        dx[i] = dy[i] * fmaf((0.5f * CARVE_GELU_C) * v * sech2, inner, fmaf(t, 0.5f, 0.5f));
    }
}

// One row's mean and reciprocal standard deviation (vector::row_statistics), one block.
__device__ __forceinline__ void carve_row_statistics(const float* x, u64 cols, float eps, float* part, float* mean,
                                                     float* rstd) {
    float s = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        s += x[c];
    }
    float m = carve_block_sum(s, part) / (float)cols;
    float q = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        float d = x[c] - m;
        q += d * d;
    }
    float var = carve_block_sum(q, part) / (float)cols;
    *mean = m;
    *rstd = 1.0f / sqrtf(var + eps);
}

// Layer normalisation (vector::layer_norm_new): one block per row; gamma then beta at params.
extern "C" __global__ void carve_layer_norm(const float* __restrict__ x, const float* __restrict__ params,
                                            float* __restrict__ y, u64 rows, u64 cols, float eps) {
    __shared__ float part[256];
    u64 r = blockIdx.x;
    if (r >= rows) {
        return;
    }
    const float* row = x + r * cols;
    float mean, rstd;
    carve_row_statistics(row, cols, eps, part, &mean, &rstd);
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        y[r * cols + c] = (row[c] - mean) * rstd * params[c] + params[cols + c];
    }
}

// Its backward pass, by rows (kernels::layer_norm_backward): each row's statistics into
// stats (mean, rstd) and, when dx is not null, the row's input gradient.
extern "C" __global__ void carve_layer_norm_backward_rows(const float* __restrict__ x, const float* __restrict__ params,
                                                          const float* __restrict__ dy, float* __restrict__ dx,
                                                          float* __restrict__ stats, u64 rows, u64 cols, float eps) {
    __shared__ float part[256];
    u64 r = blockIdx.x;
    if (r >= rows) {
        return;
    }
    const float* xr = x + r * cols;
    const float* g = dy + r * cols;
    float mean, rstd;
    carve_row_statistics(xr, cols, eps, part, &mean, &rstd);
    if (threadIdx.x == 0) {
        stats[2 * r] = mean;
        stats[2 * r + 1] = rstd;
    }
    if (dx == 0) {
        return;
    }
    float s1 = 0.0f, s2 = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        float dxhat = g[c] * params[c];
        s1 += dxhat;
        s2 += dxhat * ((xr[c] - mean) * rstd);
    }
    float m1 = carve_block_sum(s1, part) / (float)cols;
    float m2 = carve_block_sum(s2, part) / (float)cols;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        float xhat = (xr[c] - mean) * rstd;
        dx[r * cols + c] = rstd * (g[c] * params[c] - m1 - xhat * m2);
    }
}

// Its parameters' gradients: dgamma[c] = Σ_r dy·x̂, dbeta[c] = Σ_r dy, in row order.
extern "C" __global__ void carve_layer_norm_backward_params(const float* __restrict__ x, const float* __restrict__ dy,
                                                            const float* __restrict__ stats, float* __restrict__ grads,
                                                            u64 rows, u64 cols) {
    for (u64 c = carve_index(); c < cols; c += carve_stride()) {
        float dg = 0.0f, db = 0.0f;
        for (u64 r = 0; r < rows; ++r) {
            float g = dy[r * cols + c];
            dg += g * ((x[r * cols + c] - stats[2 * r]) * stats[2 * r + 1]);
            db += g;
        }
        grads[c] = dg;
        grads[cols + c] = db;
    }
}

// out[r] = table[ids[r]]; an id beyond the vocabulary (checked before it came) gives
// NaN, which the update's check refuses, rather than a read out of bounds.
extern "C" __global__ void carve_embedding(const u32* __restrict__ ids, const float* __restrict__ table,
                                           float* __restrict__ out, u64 rows, u64 width, u64 vocabulary) {
    u64 n = rows * width;
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        u64 v = ids[i / width];
        out[i] = v < vocabulary ? table[v * width + i % width] : __int_as_float(0x7fc00000);
    }
}

// dtable[v, c] = Σ over the rows r of token v of dy[r, c], in row order: one thread per
// column, which zeroes its column and then adds the rows in order (no atomics, the same
// bits every run; O(rows · width) whatever the vocabulary). Ids were checked below the
// vocabulary before they came; one that is not is skipped.
extern "C" __global__ void carve_embedding_backward(const u32* __restrict__ ids, const float* __restrict__ dy,
                                                    float* __restrict__ dtable, u64 rows, u64 width, u64 vocabulary) {
    for (u64 c = carve_index(); c < width; c += carve_stride()) {
        for (u64 v = 0; v < vocabulary; ++v) {
            dtable[v * width + c] = 0.0f;
        }
        for (u64 r = 0; r < rows; ++r) {
            u64 v = ids[r];
            if (v < vocabulary) {
                dtable[v * width + c] += dy[r * width + c];
            }
        }
    }
}

// y[b, t] = x[b, t] + table[t].
extern "C" __global__ void carve_add_positions(const float* __restrict__ x, const float* __restrict__ table,
                                               float* __restrict__ y, u64 batch, u64 steps, u64 width) {
    u64 per = steps * width, n = batch * per;
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        y[i] = x[i] + table[i % per];
    }
}

// dtable[t, c] = Σ_b dy[b, t, c] in batch order; rows past `steps` are 0.
extern "C" __global__ void carve_positions_backward(const float* __restrict__ dy, float* __restrict__ dtable, u64 batch,
                                                    u64 steps, u64 width, u64 context) {
    u64 per = steps * width, n = context * width;
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float acc = 0.0f;
        if (i < per) {
            for (u64 b = 0; b < batch; ++b) {
                acc += dy[b * per + i];
            }
        }
        dtable[i] = acc;
    }
}

extern "C" __global__ void carve_add(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y,
                                     u64 n) {
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        y[i] = a[i] + b[i];
    }
}

extern "C" __global__ void carve_add_assign(float* __restrict__ acc, const float* __restrict__ x, u64 n) {
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        acc[i] += x[i];
    }
}

// The causal softmax of the score rows of `blocks` blocks of `steps × steps` scores, each
// block at `probs + b * per_head + 2 * steps` (its statistics before it), in place: one
// block of threads per row; row i keeps keys 0..=i, the rest become 0 (vector::softmax_row).
extern "C" __global__ void carve_causal_softmax(float* __restrict__ probs, u64 blocks, u64 steps, u64 per_head) {
    __shared__ float part[256];
    u64 row = blockIdx.x;
    if (row >= blocks * steps) {
        return;
    }
    u64 b = row / steps, i = row % steps;
    float* stats = probs + b * per_head;
    float* s = stats + 2 * steps + i * steps;
    u32 t = threadIdx.x;
    float m = __int_as_float(0xff800000); // -infinity
    for (u64 j = t; j <= i; j += blockDim.x) {
        m = fmaxf(m, s[j]);
    }
    float max = carve_block_max(m, part);
    float sum = 0.0f;
    for (u64 j = t; j <= i; j += blockDim.x) {
        float e = expf(s[j] - max);
        s[j] = e;
        sum += e;
    }
    float inv = 1.0f / carve_block_sum(sum, part);
    for (u64 j = t; j < steps; j += blockDim.x) {
        s[j] = j <= i ? s[j] * inv : 0.0f;
    }
    if (t == 0) {
        stats[2 * i] = max;
        stats[2 * i + 1] = inv;
    }
}

// dS = scale · P ⊙ (dP − Σ P⊙dP) row by row (vector::causal_softmax_backward_body), dP in
// place at `dprobs + b * steps²`, P at `probs + b * per_head + 2 * steps`; keys past the
// row's step become 0.
extern "C" __global__ void carve_causal_softmax_backward(const float* __restrict__ probs, float* __restrict__ dprobs,
                                                         u64 blocks, u64 steps, u64 per_head, float scale) {
    __shared__ float part[256];
    u64 row = blockIdx.x;
    if (row >= blocks * steps) {
        return;
    }
    u64 b = row / steps, i = row % steps;
    const float* p = probs + b * per_head + 2 * steps + i * steps;
    float* d = dprobs + b * steps * steps + i * steps;
    float dot = 0.0f;
    for (u64 j = threadIdx.x; j <= i; j += blockDim.x) {
        dot += p[j] * d[j];
    }
    dot = carve_block_sum(dot, part);
    for (u64 j = threadIdx.x; j < steps; j += blockDim.x) {
        d[j] = j <= i ? scale * p[j] * (d[j] - dot) : 0.0f;
    }
}

// x *= factor (compiled and checked with the others; the update applies AdamW's decay
// itself, so that a step that is refused stores nothing).
extern "C" __global__ void carve_scale(float* __restrict__ x, u64 n, float factor) {
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        x[i] *= factor;
    }
}
