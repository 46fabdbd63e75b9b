// dearopt.backends._nccl: asynchronous NCCL collectives with integer handles.
//
// Tensors arrive as raw device pointers + element counts + NCCL dtype codes,
// and streams as integer cudaStream_t handles (torch's `data_ptr()` and
// `torch.cuda.current_stream().cuda_stream`), so the module needs neither torch
// headers nor libtorch: it builds with g++ in a few seconds.
//
// Every collective
//   1. records an event on the producer stream and makes the communicator's own
//      (non-blocking, high-priority) stream wait on it, so nothing is sent before
//      the producer computed it;
//   2. enqueues the NCCL call on the communication stream;
//   3. records a "done" event on the communication stream; the integer handle
//      returned to Python names that event.
//
// poll / wait / synchronize look at the event.  A watchdog thread checks every
// in-flight op against its deadline (issue time + timeout, or an earlier one
// asked for by wait()) and asks NCCL for asynchronous errors; on a timeout or an
// error it aborts the communicator (ncclCommAbort), which also makes the device
// work finish, and every later call raises.  Nothing here ever calls exit().
//
// The CUDA runtime is linked statically, so its "current device" is separate
// from torch's: every entry point selects the communicator's device itself.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

using Clock = std::chrono::steady_clock;

// ----------------------------------------------------------------- errors
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct NcclError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct NcclTimeoutError : NcclError {
  using NcclError::NcclError;
};
struct CommAbortedError : NcclError {
  using NcclError::NcclError;
};

// Error messages are built without iostreams: on the first GPU run a
// std::ostringstream in this module segfaulted inside the locale's codecvt
// facet (the C++ runtime loaded beside torch is not always the one whose
// headers compiled this file).  std::to_string and snprintf use the C library.
inline std::string text(const std::string& s) { return s; }
inline std::string text(const char* s) { return s != nullptr ? std::string(s) : std::string("(null)"); }
inline std::string text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
template <typename T, typename = typename std::enable_if<std::is_integral<T>::value>::type>
inline std::string text(T v) {
  return std::to_string(v);
}
template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::string out;
  using expand = int[];
  (void)expand{0, (out += text(parts), 0)...};
  return out;
}

std::string cuda_message(cudaError_t err, const char* what) {
  return cat("CUDA error in ", what, ": ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ", code ",
             static_cast<int>(err), ")");
}

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of this thread
    throw CudaError(cuda_message(err, what));
  }
}

std::string nccl_message(ncclResult_t res, const char* what, ncclComm_t comm) {
  std::string message =
      cat("NCCL error in ", what, ": ", ncclGetErrorString(res), " (ncclResult_t ", static_cast<int>(res), ")");
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') message += cat("; last NCCL error: ", last);
  return message;
}

#define CUDA_CHECK(expr) cuda_check((expr), #expr)

// Select a device for the lifetime of the guard (the static cudart has its own
// per-thread current device, which torch's set_device does not touch).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

inline cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
inline void* as_ptr(std::uintptr_t p) { return reinterpret_cast<void*>(p); }

const char* op_name(int kind) {
  switch (kind) {
    case 0: return "reduce_scatter";
    case 1: return "all_gather";
    case 2: return "all_reduce";
    case 3: return "broadcast";
    default: return "collective";
  }
}

void sleep_backoff(int& spins) {
  // spin briefly, then sleep up to 1 ms: cheap for short ops, idle for long ones
  ++spins;
  if (spins < 50) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 10 * (spins - 49))));
  }
}

Clock::time_point deadline_after(double seconds) {
  if (!(seconds > 0)) seconds = 0;
  if (seconds > 1e7) seconds = 1e7;  // "forever" without overflowing the clock
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// ----------------------------------------------------------- communicator
struct Op {
  cudaEvent_t done = nullptr;
  int kind = 0;
  Clock::time_point deadline;
};

class Communicator {
 public:
  Communicator(py::bytes unique_id, int rank, int size, int device, double timeout_s, bool watchdog)
      : rank_(rank), size_(size), device_(device), timeout_s_(timeout_s) {
    std::string raw = unique_id;
    if (raw.size() != sizeof(ncclUniqueId)) {
      throw std::invalid_argument(cat("the NCCL unique id must be ", sizeof(ncclUniqueId), " bytes, got ", raw.size()));
    }
    if (size < 1 || rank < 0 || rank >= size) {
      throw std::invalid_argument(cat("rank ", rank, " is not a rank of a world of size ", size));
    }
    if (!(timeout_s > 0)) throw std::invalid_argument("timeout_s must be positive");
    ncclUniqueId id;
    std::memcpy(&id, raw.data(), sizeof(id));
    {
      py::gil_scoped_release nogil;
      DeviceGuard guard(device_);
      int priority_low = 0, priority_high = 0;
      CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&priority_low, &priority_high));
      CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority_high));
      CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;  // init and calls return ncclInProgress: we poll them with a deadline
      ncclResult_t res = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
      try {
        settle(res, "ncclCommInitRankConfig", deadline_after(timeout_s_));
      } catch (...) {
        cleanup_cuda();
        throw;
      }
    }
    if (watchdog) watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~Communicator() {
    try {
      stop_watchdog();
      std::lock_guard<std::mutex> lock(mu_);
      if (comm_ != nullptr) {
        DeviceGuard guard(device_);
        ncclCommAbort(comm_);  // no time to flush politely in a destructor
        comm_ = nullptr;
      }
      cleanup_cuda();
    } catch (...) {
    }
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  double timeout() const { return timeout_s_; }
  std::uintptr_t stream() const { return reinterpret_cast<std::uintptr_t>(stream_); }
  bool aborted() {
    std::lock_guard<std::mutex> lock(mu_);
    return comm_ == nullptr;
  }
  std::size_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return ops_.size();
  }

  // kind: 0 reduce_scatter (count = elements per rank received), 1 all_gather
  // (count = elements per rank sent), 2 all_reduce, 3 broadcast (arg = root).
  std::int64_t issue(int kind, std::uintptr_t send, std::uintptr_t recv, std::size_t count, int dtype, int arg,
                     std::uintptr_t producer) {
    if (dtype < 0 || dtype >= static_cast<int>(ncclNumTypes)) throw std::invalid_argument("unknown NCCL dtype code");
    if (kind == 2 && (arg < 0 || arg > static_cast<int>(ncclAvg))) throw std::invalid_argument("unknown reduce op code");
    if (kind == 3 && (arg < 0 || arg >= size_)) throw std::invalid_argument("broadcast root is not a rank");
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked();
    DeviceGuard guard(device_);
    cudaEvent_t done = acquire_event_locked();
    try {
      CUDA_CHECK(cudaEventRecord(ready_, as_stream(producer)));
      CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
      ncclDataType_t type = static_cast<ncclDataType_t>(dtype);
      ncclResult_t res = ncclSuccess;
      const char* what = op_name(kind);
      switch (kind) {
        case 0:
          res = ncclReduceScatter(as_ptr(send), as_ptr(recv), count, type, ncclSum, comm_, stream_);
          what = "ncclReduceScatter";
          break;
        case 1:
          res = ncclAllGather(as_ptr(send), as_ptr(recv), count, type, comm_, stream_);
          what = "ncclAllGather";
          break;
        case 2:
          res = ncclAllReduce(as_ptr(send), as_ptr(recv), count, type, static_cast<ncclRedOp_t>(arg), comm_, stream_);
          what = "ncclAllReduce";
          break;
        case 3:
          res = ncclBroadcast(as_ptr(send), as_ptr(recv), count, type, arg, comm_, stream_);
          what = "ncclBroadcast";
          break;
        default:
          throw std::invalid_argument("unknown collective kind");
      }
      settle(res, what, deadline_after(timeout_s_));
      CUDA_CHECK(cudaEventRecord(done, stream_));
    } catch (...) {
      free_events_.push_back(done);
      throw;
    }
    std::int64_t handle = next_handle_++;
    Op op;
    op.done = done;
    op.kind = kind;
    op.deadline = deadline_after(timeout_s_);
    ops_.emplace(handle, op);
    if (ops_.size() > 256) sweep_locked();
    return handle;
  }

  // True once the op finished on the device (then its handle is released).
  bool poll(std::int64_t handle) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_handle(handle);
    check_usable_locked();
    check_async_locked();
    auto it = ops_.find(handle);
    if (it == ops_.end()) return true;  // completed earlier (released)
    DeviceGuard guard(device_);
    cudaError_t q = cudaEventQuery(it->second.done);
    if (q == cudaErrorNotReady) return false;
    cuda_check(q, "cudaEventQuery");
    release_locked(it);
    return true;
  }

  // Make compute_stream wait for the op (no host block).  timeout_s > 0 moves
  // the op's watchdog deadline to at most now + timeout_s.
  void wait(std::int64_t handle, std::uintptr_t compute_stream, double timeout_s) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    check_handle(handle);
    check_usable_locked();
    check_async_locked();
    auto it = ops_.find(handle);
    if (it == ops_.end()) return;
    DeviceGuard guard(device_);
    CUDA_CHECK(cudaStreamWaitEvent(as_stream(compute_stream), it->second.done, 0));
    if (timeout_s > 0) it->second.deadline = std::min(it->second.deadline, deadline_after(timeout_s));
  }

  // Block the host until the op finished; on timeout abort the communicator and raise.
  void synchronize(std::int64_t handle, double timeout_s) {
    py::gil_scoped_release nogil;
    if (!(timeout_s > 0)) timeout_s = timeout_s_;
    Clock::time_point deadline = deadline_after(timeout_s);
    int spins = 0;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        check_handle(handle);
        check_usable_locked();
        check_async_locked();
        auto it = ops_.find(handle);
        if (it == ops_.end()) return;
        DeviceGuard guard(device_);
        cudaError_t q = cudaEventQuery(it->second.done);
        if (q != cudaErrorNotReady) {
          cuda_check(q, "cudaEventQuery");
          release_locked(it);
          return;
        }
        if (Clock::now() >= deadline) {
          abort_locked(cat("NCCL ", op_name(it->second.kind), " (handle ", handle, ") timed out: not complete after ",
                           timeout_s, " s on rank ", rank_, " of ", size_, "; the communicator was aborted"),
                       true);
          throw NcclTimeoutError(failure_);
        }
      }
      sleep_backoff(spins);
    }
  }

  // Forget a handle (its event returns to the pool).  Unknown handles are ignored.
  void release(std::int64_t handle) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ops_.find(handle);
    if (it != ops_.end()) release_locked(it);
  }

  void abort() {
    py::gil_scoped_release nogil;
    stop_watchdog();
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ != nullptr) abort_locked("the communicator was aborted by the application", false);
  }

  // Flush in-flight ops (up to timeout_s), then finalize and destroy the
  // communicator; if that takes longer, abort it.  Idempotent.
  void close(double timeout_s) {
    py::gil_scoped_release nogil;
    if (!(timeout_s > 0)) timeout_s = timeout_s_;
    stop_watchdog();
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr) {
      cleanup_cuda();
      return;
    }
    DeviceGuard guard(device_);
    Clock::time_point deadline = deadline_after(timeout_s);
    bool clean = true;
    try {
      int spins = 0;
      for (;;) {
        cudaError_t q = cudaStreamQuery(stream_);
        if (q != cudaErrorNotReady) break;
        if (Clock::now() >= deadline) {
          clean = false;
          break;
        }
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
          clean = false;
          break;
        }
        sleep_backoff(spins);
      }
      if (clean) {
        settle(ncclCommFinalize(comm_), "ncclCommFinalize", deadline);
        ncclResult_t res = ncclCommDestroy(comm_);
        comm_ = nullptr;
        if (res != ncclSuccess && res != ncclInProgress) clean = false;
      }
    } catch (...) {
      clean = false;
    }
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (failure_.empty()) failure_ = "the communicator is closed";
    closed_ = true;
    cleanup_cuda();
  }

 private:
  // ---- everything below runs with mu_ held (or before the watchdog starts)

  // Non-blocking NCCL calls may return ncclInProgress: poll until they settle.
  void settle(ncclResult_t res, const char* what, Clock::time_point deadline) {
    int spins = 0;
    while (res == ncclInProgress) {
      if (Clock::now() >= deadline) {
        abort_locked(cat(what, " timed out on rank ", rank_, " of ", size_,
                         " (is every rank calling it? the communicator was aborted)"),
                     true);
        throw NcclTimeoutError(failure_);
      }
      sleep_backoff(spins);
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      res = r != ncclSuccess ? r : state;
    }
    if (res != ncclSuccess) {
      std::string message = nccl_message(res, what, comm_);
      abort_locked(message, false);
      throw NcclError(message);
    }
  }

  void check_handle(std::int64_t handle) const {
    if (handle <= 0 || handle >= next_handle_) {
      throw std::invalid_argument(cat("unknown NCCL handle ", handle));
    }
  }

  void check_usable_locked() const {
    if (comm_ != nullptr) return;
    if (closed_ && !timed_out_ && failure_ == "the communicator is closed") throw CommAbortedError(failure_);
    if (timed_out_) throw NcclTimeoutError(failure_);
    throw CommAbortedError(failure_.empty() ? std::string("the communicator was aborted") : failure_);
  }

  void check_async_locked() {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess || state == ncclInProgress) return;
    std::string message = nccl_message(state, "an asynchronous NCCL operation (ncclCommGetAsyncError)", comm_);
    abort_locked(message, false);
    throw NcclError(message);
  }

  void abort_locked(const std::string& why, bool timed_out) {
    if (failure_.empty() || failure_ == "the communicator is closed") {
      failure_ = why;
      timed_out_ = timed_out;
    }
    if (comm_ != nullptr) {
      DeviceGuard guard(device_);
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  cudaEvent_t acquire_event_locked() {
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  void release_locked(std::unordered_map<std::int64_t, Op>::iterator it) {
    free_events_.push_back(it->second.done);
    ops_.erase(it);
  }

  void sweep_locked() {
    for (auto it = ops_.begin(); it != ops_.end();) {
      if (cudaEventQuery(it->second.done) == cudaSuccess) {
        free_events_.push_back(it->second.done);
        it = ops_.erase(it);
      } else {
        ++it;
      }
    }
    cudaGetLastError();
  }

  void cleanup_cuda() {
    if (stream_ == nullptr && ready_ == nullptr && free_events_.empty() && ops_.empty()) return;
    try {
      DeviceGuard guard(device_);
      for (auto& kv : ops_) cudaEventDestroy(kv.second.done);  // freed once the device is done with them
      ops_.clear();
      for (auto e : free_events_) cudaEventDestroy(e);
      free_events_.clear();
      if (ready_ != nullptr) cudaEventDestroy(ready_);
      ready_ = nullptr;
      // The stream is left alive (one per communicator, as torch never destroys its own streams): tensors the
      // ops used were record_stream()ed on it, and torch's caching allocator records an event on it when they
      // are freed, later; on a destroyed stream that fails inside a destructor and aborts the process (seen on
      // an H100: tests/test_nccl_native.py::test_closed_backend_raises_collective_error).
      stream_ = nullptr;
      cudaGetLastError();
    } catch (...) {
    }
  }

  // ---- watchdog

  void watchdog_loop() {
    try {
      cudaSetDevice(device_);
    } catch (...) {
    }
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (stop_ || comm_ == nullptr) continue;
      try {
        DeviceGuard guard(device_);
        Clock::time_point now = Clock::now();
        for (auto it = ops_.begin(); it != ops_.end();) {
          cudaError_t q = cudaEventQuery(it->second.done);
          if (q == cudaSuccess) {
            free_events_.push_back(it->second.done);
            it = ops_.erase(it);
            continue;
          }
          if (q == cudaErrorNotReady && now >= it->second.deadline) {
            abort_locked(cat("NCCL ", op_name(it->second.kind), " (handle ", it->first,
                             ") timed out: the watchdog found it unfinished past its deadline (timeout ", timeout_s_,
                             " s) on rank ", rank_, " of ", size_, "; the communicator was aborted"),
                         true);
            break;
          }
          ++it;
        }
        cudaGetLastError();
        if (comm_ != nullptr) {
          ncclResult_t state = ncclSuccess;
          ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
          if (r != ncclSuccess) state = r;
          if (state != ncclSuccess && state != ncclInProgress) {
            abort_locked(nccl_message(state, "an asynchronous NCCL operation (watchdog)", comm_), false);
          }
        }
      } catch (...) {
        // never let an exception escape the thread; the next call reports the state
      }
    }
  }

  void stop_watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable() && watchdog_.get_id() != std::this_thread::get_id()) watchdog_.join();
  }

  int rank_, size_, device_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  std::unordered_map<std::int64_t, Op> ops_;
  std::vector<cudaEvent_t> free_events_;
  std::int64_t next_handle_ = 1;
  std::string failure_;
  bool timed_out_ = false;
  bool closed_ = false;
  bool stop_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread watchdog_;
};

// ------------------------------------------------------- module functions
int nccl_version() {
  int v = 0;
  ncclResult_t res = ncclGetVersion(&v);
  if (res != ncclSuccess) throw NcclError(std::string("ncclGetVersion failed: ") + ncclGetErrorString(res));
  return v;
}

py::bytes get_unique_id() {
  ncclUniqueId id;
  ncclResult_t res;
  {
    py::gil_scoped_release nogil;
    res = ncclGetUniqueId(&id);
  }
  if (res != ncclSuccess) throw NcclError(nccl_message(res, "ncclGetUniqueId", nullptr));
  return py::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
}

int cuda_device_count() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw CudaError("CUDA is not usable here: " + cuda_message(err, "cudaGetDeviceCount"));
  }
  return n;
}

int cuda_runtime_version() {
  int v = 0;
  cuda_check(cudaRuntimeGetVersion(&v), "cudaRuntimeGetVersion");
  return v;
}

int cuda_driver_version() {
  int v = 0;
  cuda_check(cudaDriverGetVersion(&v), "cudaDriverGetVersion");
  return v;  // 0 when no driver is installed
}

}  // namespace

PYBIND11_MODULE(_nccl, m) {
  m.doc() = "Asynchronous NCCL collectives on raw device pointers (dearopt's native backend)";

  auto cuda_error = py::register_exception<CudaError>(m, "CudaError", PyExc_RuntimeError);
  auto nccl_error = py::register_exception<NcclError>(m, "NcclError", PyExc_RuntimeError);
  py::register_exception<NcclTimeoutError>(m, "NcclTimeoutError", nccl_error.ptr());
  py::register_exception<CommAbortedError>(m, "CommAbortedError", nccl_error.ptr());
  (void)cuda_error;

  m.attr("NCCL_VERSION_CODE") = NCCL_VERSION_CODE;  // the header this module was built against
  m.attr("CUDART_VERSION") = CUDART_VERSION;
  m.attr("UNIQUE_ID_BYTES") = static_cast<int>(sizeof(ncclUniqueId));

  py::dict dtypes;
  dtypes["int8"] = static_cast<int>(ncclInt8);
  dtypes["uint8"] = static_cast<int>(ncclUint8);
  dtypes["int32"] = static_cast<int>(ncclInt32);
  dtypes["uint32"] = static_cast<int>(ncclUint32);
  dtypes["int64"] = static_cast<int>(ncclInt64);
  dtypes["uint64"] = static_cast<int>(ncclUint64);
  dtypes["float16"] = static_cast<int>(ncclFloat16);
  dtypes["float32"] = static_cast<int>(ncclFloat32);
  dtypes["float64"] = static_cast<int>(ncclFloat64);
  dtypes["bfloat16"] = static_cast<int>(ncclBfloat16);
  m.attr("DTYPES") = dtypes;

  py::dict ops;
  ops["sum"] = static_cast<int>(ncclSum);
  ops["product"] = static_cast<int>(ncclProd);
  ops["max"] = static_cast<int>(ncclMax);
  ops["min"] = static_cast<int>(ncclMin);
  ops["avg"] = static_cast<int>(ncclAvg);
  m.attr("REDUCE_OPS") = ops;

  m.def("nccl_version", &nccl_version, "The NCCL library's version code (ncclGetVersion), e.g. 23203 for 2.32.3");
  m.def("get_unique_id", &get_unique_id, "A new ncclUniqueId as bytes (rank 0 makes it, every rank uses it)");
  m.def("cuda_device_count", &cuda_device_count,
        "The number of CUDA devices; raises CudaError with CUDA's reason when CUDA is not usable");
  m.def("cuda_runtime_version", &cuda_runtime_version);
  m.def("cuda_driver_version", &cuda_driver_version);

  py::class_<Communicator>(m, "Communicator")
      .def(py::init<py::bytes, int, int, int, double, bool>(), py::arg("unique_id"), py::arg("rank"), py::arg("size"),
           py::arg("device"), py::arg("timeout_s") = 300.0, py::arg("watchdog") = true)
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("device", &Communicator::device)
      .def_property_readonly("timeout", &Communicator::timeout)
      .def_property_readonly("stream", &Communicator::stream, "the communication stream as an integer cudaStream_t")
      .def_property_readonly("aborted", &Communicator::aborted)
      .def_property_readonly("pending", &Communicator::pending, "handles in flight (not yet seen complete)")
      .def(
          "reduce_scatter",
          [](Communicator& c, std::uintptr_t send, std::uintptr_t recv, std::size_t recv_count, int dtype,
             std::uintptr_t stream) { return c.issue(0, send, recv, recv_count, dtype, 0, stream); },
          py::arg("send"), py::arg("recv"), py::arg("recv_count"), py::arg("dtype"), py::arg("stream"))
      .def(
          "all_gather",
          [](Communicator& c, std::uintptr_t send, std::uintptr_t recv, std::size_t send_count, int dtype,
             std::uintptr_t stream) { return c.issue(1, send, recv, send_count, dtype, 0, stream); },
          py::arg("send"), py::arg("recv"), py::arg("send_count"), py::arg("dtype"), py::arg("stream"))
      .def(
          "all_reduce",
          [](Communicator& c, std::uintptr_t send, std::uintptr_t recv, std::size_t count, int dtype, int op,
             std::uintptr_t stream) { return c.issue(2, send, recv, count, dtype, op, stream); },
          py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("stream"))
      .def(
          "broadcast",
          [](Communicator& c, std::uintptr_t send, std::uintptr_t recv, std::size_t count, int dtype, int root,
             std::uintptr_t stream) { return c.issue(3, send, recv, count, dtype, root, stream); },
          py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"), py::arg("root"), py::arg("stream"))
      .def("poll", &Communicator::poll, py::arg("handle"))
      .def("wait", &Communicator::wait, py::arg("handle"), py::arg("stream"), py::arg("timeout_s") = 0.0)
      .def("synchronize", &Communicator::synchronize, py::arg("handle"), py::arg("timeout_s") = 0.0)
      .def("release", &Communicator::release, py::arg("handle"))
      .def("abort", &Communicator::abort)
      .def("close", &Communicator::close, py::arg("timeout_s") = 0.0);
}
