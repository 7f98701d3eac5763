// All-reduce and all-gather between the ranks of one machine through a shared memory segment.
//
// Layout of the segment: one 64-byte line per rank holding the sequence number that rank has reached
// (and, at byte 8, how many ranks sleep on it),
// then two buffers of `world` slots of `slot_bytes` each. Operation `seq` (1, 2, ...) uses buffer
// seq & 1: every rank copies its data into its own slot, publishes `seq` (release), waits until every
// rank has published `seq` (acquire), then reads all slots. A rank can only start operation seq + 2,
// which overwrites its slot of this buffer, after every rank published seq + 1, that is after every
// rank finished reading operation seq: one wait per operation, no second barrier.
//
// Sums run over the ranks in rank order on every rank, so every rank gets the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <climits>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLine = 64;

inline std::atomic<int64_t>* flag(uint8_t* base, int64_t rank) {
    return reinterpret_cast<std::atomic<int64_t>*>(base + rank * kLine);
}

inline uint8_t* slot(uint8_t* base, int64_t world, int64_t slot_bytes, int64_t seq, int64_t rank) {
    uint8_t* data = base + world * kLine;
    return data + ((seq & 1) * world + rank) * slot_bytes;
}

inline std::atomic<int32_t>* sleepers(uint8_t* base, int64_t rank) {
    return reinterpret_cast<std::atomic<int32_t>*>(base + rank * kLine + 8);
}

// Publish this rank's arrival at `seq` and wake whoever sleeps on it.
void arrive(uint8_t* base, int64_t rank, int64_t seq) {
    flag(base, rank)->store(seq, std::memory_order_seq_cst);
    if (sleepers(base, rank)->load(std::memory_order_seq_cst) > 0) {
        syscall(SYS_futex, reinterpret_cast<int32_t*>(flag(base, rank)), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
    }
}

// Spin briefly (the ranks of a decode step arrive within microseconds of each other), then sleep on a
// futex until the peer arrives: a waiting rank must not hold a CPU the peer may need (virtual machines
// whose vCPUs share host cores, more ranks than cores, other programs on the same cores).
void wait_all(uint8_t* base, int64_t world, int64_t seq, double timeout_s, double spin_s) {
    auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < world; ++r) {
        auto* f = flag(base, r);
        int64_t spins = 0;
        while (f->load(std::memory_order_acquire) < seq) {
#if defined(__x86_64__)
            _mm_pause();
#endif
            if (++spins % 64 != 0) continue;
            double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (waited > timeout_s) {
                throw std::runtime_error(
                    "shared-memory collective: rank " + std::to_string(r) + " did not arrive within " +
                    std::to_string(timeout_s) + " s (it died or hangs)");
            }
            if (waited > spin_s) {
                // Dekker order: count ourselves as a sleeper, then re-read; the peer stores, then reads the
                // count. FUTEX_WAIT returns at once if the low word changed meanwhile.
                sleepers(base, r)->fetch_add(1, std::memory_order_seq_cst);
                int64_t seen = f->load(std::memory_order_seq_cst);
                if (seen < seq) {
                    struct timespec nap = {0, 100 * 1000 * 1000};  // wake up to check the timeout
                    syscall(SYS_futex, reinterpret_cast<int32_t*>(f), FUTEX_WAIT, static_cast<int32_t>(seen), &nap,
                            nullptr, 0);
                }
                sleepers(base, r)->fetch_sub(1, std::memory_order_seq_cst);
            }
        }
    }
}

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
    bits += 0x7fff + ((bits >> 16) & 1);
    return static_cast<uint16_t>(bits >> 16);
}

void sum_float(float* out, uint8_t* const* srcs, int64_t world, int64_t n) {
    at::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) {
        const float* s0 = reinterpret_cast<const float*>(srcs[0]);
        for (int64_t i = b; i < e; ++i) out[i] = s0[i];
        for (int64_t r = 1; r < world; ++r) {
            const float* s = reinterpret_cast<const float*>(srcs[r]);
            for (int64_t i = b; i < e; ++i) out[i] += s[i];
        }
    });
}

void sum_bf16(uint16_t* out, uint8_t* const* srcs, int64_t world, int64_t n) {
    at::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
            float acc = bf16_to_float(reinterpret_cast<const uint16_t*>(srcs[0])[i]);
            for (int64_t r = 1; r < world; ++r) acc += bf16_to_float(reinterpret_cast<const uint16_t*>(srcs[r])[i]);
            out[i] = float_to_bf16(acc);
        }
    });
}

void check_args(const torch::Tensor& x, const torch::Tensor& shm, int64_t rank, int64_t world, int64_t slot_bytes) {
    TORCH_CHECK(x.is_contiguous(), "shm collective: tensor must be contiguous");
    TORCH_CHECK(shm.is_contiguous() && shm.scalar_type() == torch::kUInt8, "shm collective: bad segment");
    TORCH_CHECK(0 <= rank && rank < world && world <= 64, "shm collective: bad rank / world");
    TORCH_CHECK(shm.numel() >= world * kLine + 2 * world * slot_bytes, "shm collective: segment too small");
}

}  // namespace

// In place: x becomes the sum of every rank's x. Returns the next sequence number.
int64_t shm_all_reduce(torch::Tensor x, torch::Tensor shm, int64_t rank, int64_t world, int64_t seq,
                       int64_t slot_bytes, double timeout_s, double spin_s) {
    check_args(x, shm, rank, world, slot_bytes);
    const auto dtype = x.scalar_type();
    TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, "shm all-reduce: float32 or bfloat16 only");
    uint8_t* base = shm.data_ptr<uint8_t>();
    const int64_t elem = x.element_size();
    const int64_t per_chunk = slot_bytes / elem;
    uint8_t* data = static_cast<uint8_t*>(x.data_ptr());
    const int64_t total = x.numel();
    std::vector<uint8_t*> srcs(world);
    for (int64_t start = 0; start < total; start += per_chunk) {
        const int64_t n = std::min(per_chunk, total - start);
        ++seq;
        std::memcpy(slot(base, world, slot_bytes, seq, rank), data + start * elem, n * elem);
        arrive(base, rank, seq);
        {
            pybind11::gil_scoped_release no_gil;
            wait_all(base, world, seq, timeout_s, spin_s);
        }
        for (int64_t r = 0; r < world; ++r) srcs[r] = slot(base, world, slot_bytes, seq, r);
        if (dtype == torch::kFloat) {
            sum_float(reinterpret_cast<float*>(data) + start, srcs.data(), world, n);
        } else {
            sum_bf16(reinterpret_cast<uint16_t*>(data) + start, srcs.data(), world, n);
        }
    }
    return seq;
}

// out[r] = rank r's x, for out of shape [world, *x.shape]. Returns the next sequence number.
int64_t shm_all_gather(torch::Tensor x, torch::Tensor out, torch::Tensor shm, int64_t rank, int64_t world,
                       int64_t seq, int64_t slot_bytes, double timeout_s, double spin_s) {
    check_args(x, shm, rank, world, slot_bytes);
    TORCH_CHECK(out.is_contiguous() && out.numel() == world * x.numel() && out.scalar_type() == x.scalar_type(),
                "shm all-gather: out must be a contiguous [world, *x.shape] tensor of x's dtype");
    uint8_t* base = shm.data_ptr<uint8_t>();
    const int64_t bytes = x.numel() * x.element_size();
    const uint8_t* src = static_cast<const uint8_t*>(x.data_ptr());
    uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
    for (int64_t start = 0; start < bytes; start += slot_bytes) {
        const int64_t n = std::min(slot_bytes, bytes - start);
        ++seq;
        std::memcpy(slot(base, world, slot_bytes, seq, rank), src + start, n);
        arrive(base, rank, seq);
        {
            pybind11::gil_scoped_release no_gil;
            wait_all(base, world, seq, timeout_s, spin_s);
        }
        for (int64_t r = 0; r < world; ++r) std::memcpy(dst + r * bytes + start, slot(base, world, slot_bytes, seq, r), n);
    }
    return seq;
}

// Every rank arrives before any leaves. Returns the next sequence number.
int64_t shm_barrier(torch::Tensor shm, int64_t rank, int64_t world, int64_t seq, double timeout_s, double spin_s) {
    uint8_t* base = shm.data_ptr<uint8_t>();
    ++seq;
    arrive(base, rank, seq);
    pybind11::gil_scoped_release no_gil;
    wait_all(base, world, seq, timeout_s, spin_s);
    return seq;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("all_reduce", &shm_all_reduce, "in-place sum over the ranks of one machine through shared memory");
    m.def("all_gather", &shm_all_gather, "gather every rank's tensor through shared memory");
    m.def("barrier", &shm_barrier, "shared-memory barrier");
}
