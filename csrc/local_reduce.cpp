// The all-reduce of tensor-parallel ranks that share one machine, through shared memory, as an MLX
// primitive (so it stays lazy and runs in the forward's graph like mx.distributed.all_sum).
//
// MLX's ring backend sums over TCP even on 127.0.0.1: each sum is syscalls on both sides and a
// wakeup of the waiting rank, and a decode step has two per layer. On the 2-vCPU build machine a
// step's 16 sums cost ~3.7 ms inside the forward (docs/BENCHMARKS.md, issue 17). Here each rank
// copies its part into its own slot of a shared file, publishes a sequence number, waits (spinning
// briefly, then on a futex) for every rank's number, and sums the slots in rank order, so every
// rank gets the same bits.
//
// Layout of the file: a 4 KiB header (below), then per rank two slots of `slot_bytes`. Sum k uses
// slot k % 2: a rank can only write slot k % 2 again for sum k + 2 after every rank published sum
// k + 1, which each does only after it finished reading sum k.
//
// A peer that exits, or a rank that gives up (`abort`), makes every waiting sum throw: MLX stores
// the error in the stream and raises it from the eval, as it does for a ring peer that is lost.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define MESHLM_PAUSE() _mm_pause()
#else
#define MESHLM_PAUSE() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr uint32_t MAGIC = 0x6d6c7231;  // "mlr1": this layout
constexpr int MAX_RANKS = 16;
constexpr size_t HEADER_BYTES = 4096;

struct alignas(64) Word {
  std::atomic<uint32_t> value;
};

struct Header {
  std::atomic<uint32_t> magic, world;
  std::atomic<uint64_t> slot_bytes;
  Word failed;                // nonzero once any rank gave up: 1 + that rank
  Word joined;                // ranks that have mapped the file
  Word arrived[MAX_RANKS];    // the last sum whose part this rank has published
  Word sleepers[MAX_RANKS];   // ranks asleep on arrived[r]'s futex
  std::atomic<int32_t> pid[MAX_RANKS];
};
static_assert(sizeof(Header) <= HEADER_BYTES);
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free);

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// Whether process `pid` is still running: a killed child stays a zombie until its parent reaps it.
bool running(int32_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no procfs: trust kill()
  auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'Z';
}

class LocalGroup {
 public:
  // `create`: this rank makes the file (replacing any left by an earlier group); the others open it.
  LocalGroup(const std::string& path, int rank, int world, size_t slot_bytes, double spin_us, bool create)
      : rank_(rank), world_(world), slot_bytes_(slot_bytes), spin_us_(spin_us) {
    if (world < 1 || world > MAX_RANKS || rank < 0 || rank >= world) {
      throw std::invalid_argument("local_reduce: rank " + std::to_string(rank) + " of " + std::to_string(world) +
                                  " (at most " + std::to_string(MAX_RANKS) + " ranks)");
    }
    if (slot_bytes < 64 || slot_bytes % 64 != 0) throw std::invalid_argument("local_reduce: slot_bytes % 64 != 0");
    bytes_ = HEADER_BYTES + static_cast<size_t>(world) * 2 * slot_bytes;
    if (create) unlink(path.c_str());
    int fd = open(path.c_str(), create ? O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC : O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
      throw std::runtime_error("local_reduce: cannot " + std::string(create ? "create " : "open ") + path + ": " +
                               std::strerror(errno));
    }
    struct stat st {};
    if (create ? ftruncate(fd, bytes_) != 0 : fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes_) {
      std::string why = create ? std::string("cannot size it: ") + std::strerror(errno) : "not this group's layout";
      ::close(fd);
      throw std::runtime_error("local_reduce: " + path + ": " + why);
    }
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    ::close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("local_reduce: cannot map " + path + ": " + std::strerror(err));
    base_ = static_cast<char*>(p);
    h_ = reinterpret_cast<Header*>(base_);
    // The creator writes the layout; every rank checks it declares the same one.
    if (!agree(h_->magic, MAGIC) || !agree(h_->world, static_cast<uint32_t>(world)) ||
        !agree(h_->slot_bytes, static_cast<uint64_t>(slot_bytes))) {
      munmap(base_, bytes_);
      throw std::runtime_error("local_reduce: " + path + " holds another group's layout");
    }
    h_->pid[rank].store(getpid());
    h_->joined.value.fetch_add(1);
  }

  ~LocalGroup() { munmap(base_, bytes_); }

  // out = the sum over ranks of every rank's `in`, n floats, in slot-sized rounds.
  void all_sum(const float* in, float* out, size_t n) {
    auto t0 = std::chrono::steady_clock::now();
    size_t per = slot_bytes_ / sizeof(float);
    for (size_t off = 0; off < n; off += per) {
      size_t m = std::min(per, n - off);
      if (failed()) throw_failed();
      uint32_t seq = ++seq_;
      std::memcpy(slot(rank_, seq), in + off, m * sizeof(float));
      publish(seq);
      auto w0 = std::chrono::steady_clock::now();
      for (int r = 0; r < world_; ++r) {
        if (r != rank_) wait_for(r, seq);
      }
      wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - w0).count(),
                         std::memory_order_relaxed);
      const float* first = slot(0, seq);
      std::memcpy(out + off, first, m * sizeof(float));
      for (int r = 1; r < world_; ++r) {  // rank order: the same bits on every rank
        const float* s = slot(r, seq);
        float* o = out + off;
        for (size_t i = 0; i < m; ++i) o[i] += s[i];
      }
    }
    sums_.fetch_add(1, std::memory_order_relaxed);
    total_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
                        std::memory_order_relaxed);
  }

  // (sums, seconds in them, of which waiting for the other ranks' parts) since this rank attached.
  std::tuple<uint64_t, double, double> stats() const {
    return {sums_.load(), total_ns_.load() * 1e-9, wait_ns_.load() * 1e-9};
  }

  // Make every rank's waiting sums (and this rank's next ones) throw.
  void abort() {
    uint32_t none = 0;
    h_->failed.value.compare_exchange_strong(none, static_cast<uint32_t>(rank_) + 1);
    for (int r = 0; r < world_; ++r) futex(&h_->arrived[r].value, FUTEX_WAKE, INT_MAX, nullptr);
  }

  bool failed() const { return h_->failed.value.load() != 0; }
  int joined() const { return static_cast<int>(h_->joined.value.load()); }

 private:
  template <typename T>
  static bool agree(std::atomic<T>& field, T value) {
    T expected = 0;
    return field.compare_exchange_strong(expected, value) || expected == value;
  }

  float* slot(int r, uint32_t seq) {
    return reinterpret_cast<float*>(base_ + HEADER_BYTES + (static_cast<size_t>(r) * 2 + (seq & 1)) * slot_bytes_);
  }

  void publish(uint32_t seq) {
    h_->arrived[rank_].value.store(seq, std::memory_order_seq_cst);
    if (h_->sleepers[rank_].value.load(std::memory_order_seq_cst) != 0) {
      futex(&h_->arrived[rank_].value, FUTEX_WAKE, INT_MAX, nullptr);
    }
  }

  static bool reached(uint32_t arrived, uint32_t seq) { return static_cast<int32_t>(arrived - seq) >= 0; }

  void wait_for(int r, uint32_t seq) {
    auto& word = h_->arrived[r].value;
    // Spin first: ranks reach a sum within microseconds of each other when both are computing, and
    // a futex wakeup costs tens of microseconds in a VM.
    auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(spin_us_);
    for (int i = 0;; ++i) {
      if (reached(word.load(std::memory_order_acquire), seq)) return;
      MESHLM_PAUSE();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) break;
    }
    const timespec tick{0, 50'000'000};  // health checks while asleep
    for (;;) {
      h_->sleepers[r].value.fetch_add(1, std::memory_order_seq_cst);
      uint32_t seen = word.load(std::memory_order_seq_cst);
      if (!reached(seen, seq) && !failed()) futex(&word, FUTEX_WAIT, seen, &tick);
      h_->sleepers[r].value.fetch_sub(1, std::memory_order_seq_cst);
      if (reached(word.load(std::memory_order_acquire), seq)) return;
      check(r);
    }
  }

  [[noreturn]] void throw_failed() {
    uint32_t who = h_->failed.value.load();
    throw std::runtime_error("local all-reduce: peer lost (rank " + std::to_string(who - 1) + " gave up)");
  }

  void check(int r) {
    if (failed()) throw_failed();
    int32_t pid = h_->pid[r].load();
    if (pid != 0 && !running(pid)) {
      abort();
      throw std::runtime_error("local all-reduce: peer lost (rank " + std::to_string(r) + ", pid " +
                               std::to_string(pid) + ", exited)");
    }
  }

  int rank_, world_;
  size_t slot_bytes_;
  double spin_us_;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  Header* h_ = nullptr;
  uint32_t seq_ = 0;  // sums started here: only the stream's thread runs them, in graph order
  std::atomic<uint64_t> sums_{0}, total_ns_{0}, wait_ns_{0};  // read by other threads (metrics)
};

class AllSum : public mx::UnaryPrimitive {
 public:
  AllSum(mx::Stream s, std::shared_ptr<LocalGroup> group) : mx::UnaryPrimitive(s), group_(std::move(group)) {}
  const char* name() const override { return "MeshlmLocalAllSum"; }
  // Never merged with another sum of the same input: each is one round every rank takes part in.
  bool is_equivalent(const mx::Primitive&) const override { return false; }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("meshlm's local all-reduce runs on the CPU only");
  }
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(in[0]);
    enc.set_output_array(out);
    enc.dispatch([g = group_, x = in[0].data<float>(), o = out.data<float>(), n = out.size()]() {
      g->all_sum(x, o, n);
    });
  }

 private:
  std::shared_ptr<LocalGroup> group_;
};

mx::array all_sum(const mx::array& x, std::shared_ptr<LocalGroup> group) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("local_reduce.all_sum takes float32 arrays");
  auto s = mx::to_stream(mx::StreamOrDevice{});
  auto xc = mx::contiguous(x, false, s);
  return mx::array(x.shape(), mx::float32, std::make_shared<AllSum>(s, std::move(group)), {xc});
}

}  // namespace

NB_MODULE(_local_reduce, m) {
  m.doc() = "meshlm's shared-memory all-reduce for tensor-parallel ranks on one machine";
  m.attr("mlx_version") = MESHLM_MLX_VERSION;
  nb::class_<LocalGroup>(m, "LocalGroup")
      .def(nb::init<const std::string&, int, int, size_t, double, bool>(), nb::arg("path"), nb::arg("rank"),
           nb::arg("world"), nb::arg("slot_bytes"), nb::arg("spin_us"), nb::arg("create"),
           "join the group whose ranks share the file at `path`; one rank creates it (`create`), before the "
           "others open it")
      .def("abort", &LocalGroup::abort, "make every rank's waiting and later sums raise")
      .def_prop_ro("failed", &LocalGroup::failed)
      .def_prop_ro("joined", &LocalGroup::joined, "ranks that have mapped the file so far")
      .def("stats", &LocalGroup::stats, "(sums, seconds in them, seconds of which waiting for the other ranks)");
  m.def("all_sum", &all_sum, nb::arg("x"), nb::arg("group"), "the sum of x over the group's ranks (lazy)");
}
