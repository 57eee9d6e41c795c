// carve's device kernels: every operation of a training step but the matrix products
// (cuBLAS runs those). Compiled once per process by NVRTC (src/nn/device/cuda.rs), and in
// CI without a GPU, so that a kernel that does not compile fails there.
//
// Arrays are f32, row-major, at device addresses the step's workspaces hand out. Each
// kernel mirrors the host arithmetic of the function its comment names, in the same
// order where the order decides the bits (sums run in row order, one thread per sum).

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
    part[t] = m;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            part[t] = fmaxf(part[t], part[t + s]);
        }
        __syncthreads();
    }
    float max = part[0];
    __syncthreads();
    float sum = 0.0f;
    for (u64 c = t; c < classes; c += blockDim.x) {
        float e = expf(x[c] - max);
        g[c] = e;
        sum += e;
    }
    part[t] = sum;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            part[t] += part[t + s];
        }
        __syncthreads();
    }
    float inv = 1.0f / part[0];
    u32 label = labels[r];
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
                                            float beta1, float beta2, float epsilon, float step, u32* status) {
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float m_new, v_new, u;
        carve_adam(beta1, beta2, epsilon, step, m[i], v[i], grad[i], &m_new, &v_new, &u);
        if (!(carve_finite(m_new) && carve_finite(v_new) && carve_finite(u) && carve_finite(w[i] + u))) {
            atomicMax(status, (u32)(n - i));
        }
    }
}

// Stores the Adam step that carve_adam_check found finite; stores nothing when it did not.
extern "C" __global__ void carve_adam_commit(float* __restrict__ w, const float* __restrict__ grad,
                                             float* __restrict__ m, float* __restrict__ v, u64 n, float beta1,
                                             float beta2, float epsilon, float step, const u32* status) {
    if (*status != 0) {
        return;
    }
    for (u64 i = carve_index(); i < n; i += carve_stride()) {
        float m_new, v_new, u;
        carve_adam(beta1, beta2, epsilon, step, m[i], v[i], grad[i], &m_new, &v_new, &u);
        m[i] = m_new;
        v[i] = v_new;
        w[i] += u;
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
