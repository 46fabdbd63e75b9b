// dearopt.engine._ready: a bucket's gradients counted in C++, as DDP's reducer counts them.
//
// A post hook on every parameter's AccumulateGrad node (the node autograd runs once a parameter's gradient has been
// accumulated into .grad) does, per parameter and without the GIL:
//   * if .grad is not the parameter's view into its bucket (the loop cleared it, so autograd made a new tensor, or
//     set another tensor), copy it into the view and make the view .grad again (a sparse gradient densely, noted);
//   * count the parameter ready in its bucket, once per backward pass.
// Python is called only where something happens for a whole backward or bucket: `on_first()` at the first hook of a
// backward (once `expect_backward()` was called) and `on_bucket(b)` when bucket b has all its gradients (or, with
// `per_param(true)`, `on_param(slot)` at every hook: the engine's Python path, for the steps that time each
// gradient), or, with `timing(true)`, each parameter's arrival time noted in C++ (`stamps()`, CLOCK_MONOTONIC
// seconds as Python's time.perf_counter, the profile's steps) while still counting.  Which bucket and position each parameter has is the bound plan's (`bind`), replaced whole by a
// re-plan; the hooks stay for the life of the object (`remove()` takes them off).
//
// ForwardGate: the module forward pre-hooks of a model, one callable per module, in C++: while armed, a module whose
// parameters lie in a bucket beyond the one the forward has reached calls `reach(bucket)` (Python applies the
// updates due up to it); every other module passes at the cost of one C call, no Python frame.
//
// WeakCall: how both reach Python: a method of an object held through a weak reference (`owner.name(b)` while the
// owner lives, nothing once it is gone), so that the hooks keep no engine alive and a copy of the model reaches
// none; the engine hands them the method of the part that does the work (the rounds part's `bucket_ready`,
// `reach_bucket`), with no Python relay frame between.  An exception the method raises goes to
// `on_error(exc, owner, name)`, which raises what the engine reports (a bug becomes a named error).
#include <torch/extension.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;
using torch::autograd::Variable;
using torch::autograd::variable_list;

namespace {

using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const Variable&>()));

class WeakCall {
 public:
  WeakCall() = default;
  // owner None: a call that does nothing.
  WeakCall(const py::object& owner, const std::string& name, py::object on_error)
      : name_(py::str(name)), on_error_(std::move(on_error)) {
    if (!owner.is_none()) ref_ = py::weakref(owner);
  }

  // `owner.name()` (b < 0) or `owner.name(b)`; needs the GIL.
  void operator()(int64_t b) const {
    if (!ref_) return;
    py::object owner = ref_();
    if (owner.is_none()) return;
    try {
      py::object method = owner.attr(name_);
      if (b < 0)
        method();
      else
        method(b);
    } catch (py::error_already_set& e) {
      if (on_error_ && !on_error_.is_none()) on_error_(e.value(), owner, name_);  // raises the error to report
      throw;
    }
  }

 private:
  py::object ref_, name_, on_error_;
};

class ReadyHooks : public std::enable_shared_from_this<ReadyHooks> {
 public:
  ReadyHooks(WeakCall on_first, WeakCall on_bucket, WeakCall on_param)
      : on_first_(std::move(on_first)), on_bucket_(std::move(on_bucket)), on_param_(std::move(on_param)) {}

  ~ReadyHooks() { remove(); }

  // Hook these parameters (each once); returns their slots.
  std::vector<int64_t> add(const std::vector<at::Tensor>& params) {
    std::vector<int64_t> out;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& p : params) {
      TORCH_CHECK(p.requires_grad(), "dearopt._ready: a parameter that does not require grad cannot be hooked");
      const int64_t slot = static_cast<int64_t>(params_.size());
      auto acc = torch::autograd::impl::grad_accumulator(p);
      TORCH_CHECK(acc, "dearopt._ready: no gradient accumulator (is the parameter a leaf?)");
      std::weak_ptr<ReadyHooks> weak = weak_from_this();
      auto key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, slot](const variable_list& outputs, const variable_list& /*inputs*/) {
            if (auto self = weak.lock()) {
              self->on_ready(slot);
            }
            return outputs;
          }));
      params_.push_back(p);
      hooks_.emplace_back(std::move(acc), key);
      bucket_of_.push_back(-1);
      pos_of_.push_back(0);
      views_.emplace_back();
      sparse_.push_back(0);
      out.push_back(slot);
    }
    return out;
  }

  // The bound plan: slot -> (bucket, position, view); bucket sizes.  Slots not listed are not counted.
  void bind(const std::vector<int64_t>& slots, const std::vector<int64_t>& buckets, const std::vector<int64_t>& pos,
            const std::vector<at::Tensor>& views, const std::vector<int64_t>& sizes) {
    TORCH_CHECK(slots.size() == buckets.size() && slots.size() == pos.size() && slots.size() == views.size(),
                "dearopt._ready.bind: slots, buckets, positions and views differ in length");
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(bucket_of_.begin(), bucket_of_.end(), -1);
    for (auto& v : views_) v = at::Tensor();
    for (size_t i = 0; i < slots.size(); ++i) {
      const auto s = slots[i];
      TORCH_CHECK(s >= 0 && s < static_cast<int64_t>(params_.size()), "dearopt._ready.bind: unknown slot ", s);
      bucket_of_[s] = buckets[i];
      pos_of_[s] = pos[i];
      views_[s] = views[i];
    }
    sizes_ = sizes;
    ready_.assign(sizes.size(), 0);
    counted_.clear();
    for (auto n : sizes) counted_.emplace_back(static_cast<size_t>(n), 0);
  }

  // Count nothing (no plan bound, or the Python hooks count this backward).
  void unbind() {
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(bucket_of_.begin(), bucket_of_.end(), -1);
    for (auto& v : views_) v = at::Tensor();
    sizes_.clear();
    ready_.clear();
    counted_.clear();
  }

  // The next hook that fires begins a backward pass: on_first() is called, the counts start from zero.
  void expect_backward() {
    std::lock_guard<std::mutex> lock(mu_);
    expect_ = true;
  }

  // Start counting a new pass now (the counts from zero), without calling on_first().
  void begin_pass() {
    std::lock_guard<std::mutex> lock(mu_);
    reset_counts();
  }

  // Stop counting until expect_backward() or begin_pass() (gradients are still moved into their views).
  void pause() {
    std::lock_guard<std::mutex> lock(mu_);
    counting_ = false;
  }

  // Every hook calls on_param(slot) instead of counting (the engine's Python path).
  void per_param(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    per_param_ = on;
  }

  // Note each parameter's first arrival in a pass (seconds of the monotonic clock) while counting.
  void timing(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    timing_ = on;
    stamps_.assign(params_.size(), NAN);
  }

  // The arrival times of this pass by slot (NaN: not arrived).
  std::vector<double> stamps() {
    std::lock_guard<std::mutex> lock(mu_);
    return stamps_;
  }

  py::bytes counted(int64_t b) {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(b >= 0 && b < static_cast<int64_t>(counted_.size()), "dearopt._ready: no bucket ", b);
    const auto& c = counted_[b];
    return py::bytes(reinterpret_cast<const char*>(c.data()), c.size());
  }

  int64_t ready(int64_t b) {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(b >= 0 && b < static_cast<int64_t>(ready_.size()), "dearopt._ready: no bucket ", b);
    return ready_[b];
  }

  // Slots whose gradient arrived sparse (nn.Embedding(sparse=True)); noted once, kept.
  std::vector<int64_t> sparse_slots() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> out;
    for (size_t s = 0; s < sparse_.size(); ++s)
      if (sparse_[s]) out.push_back(static_cast<int64_t>(s));
    return out;
  }

  int64_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(params_.size());
  }

  // Take every hook off (the engine is closed); idempotent.
  void remove() {
    std::vector<std::pair<NodePtr, uintptr_t>> hooks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      hooks.swap(hooks_);
      params_.clear();
      views_.clear();
      bucket_of_.clear();
      pos_of_.clear();
      sparse_.clear();
      sizes_.clear();
      ready_.clear();
      counted_.clear();
    }
    for (auto& h : hooks) {
      if (h.first) h.first->del_post_hook(h.second);
    }
  }

 private:
  void reset_counts() {
    expect_ = false;
    counting_ = true;
    std::fill(ready_.begin(), ready_.end(), 0);
    for (auto& c : counted_) std::fill(c.begin(), c.end(), 0);
    if (timing_) stamps_.assign(params_.size(), NAN);
  }

  // Runs on the thread autograd runs this parameter's accumulation on, without the GIL.
  void on_ready(int64_t slot) {
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (slot >= static_cast<int64_t>(params_.size())) return;  // removed
      first = expect_;
      if (first) reset_counts();
    }
    if (first) call(on_first_, -1);  // may re-plan: what the slot maps to is read below
    int64_t complete = -1;
    bool python = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (slot >= static_cast<int64_t>(params_.size())) return;
      python = per_param_;
    }
    if (python) {
      call(on_param_, slot);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (slot >= static_cast<int64_t>(params_.size())) return;
      const int64_t b = bucket_of_[slot];
      if (b < 0) return;
      const at::Tensor& view = views_[slot];
      at::Tensor& grad = params_[slot].mutable_grad();
      if (grad.defined() && view.defined() &&
          (grad.is_sparse() || grad.data_ptr() != view.data_ptr() || grad.sizes() != view.sizes())) {
        // the loop cleared p.grad (autograd made a new tensor) or put another one there: into the view
        if (grad.is_sparse()) {
          sparse_[slot] = 1;
          view.copy_(grad.to_dense());
        } else {
          view.copy_(grad);
        }
        grad = view;
      }
      if (!counting_) return;
      auto& c = counted_[b][pos_of_[slot]];
      if (c) return;  // counted in this pass already
      c = 1;
      if (timing_ && slot < static_cast<int64_t>(stamps_.size()))
        stamps_[slot] = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
      if (++ready_[b] == sizes_[b]) complete = b;
    }
    if (complete >= 0) call(on_bucket_, complete);
  }

  void call(const WeakCall& fn, int64_t b) {
    py::gil_scoped_acquire gil;
    try {
      fn(b);
    } catch (py::error_already_set& e) {
      e.restore();  // the Python exception itself reaches the caller of backward()
      throw python_error();
    }
  }

  WeakCall on_first_, on_bucket_, on_param_;
  std::mutex mu_;
  std::vector<at::Tensor> params_;
  std::vector<std::pair<NodePtr, uintptr_t>> hooks_;
  std::vector<int64_t> bucket_of_, pos_of_;
  std::vector<at::Tensor> views_;
  std::vector<uint8_t> sparse_;
  std::vector<int64_t> sizes_, ready_;
  std::vector<std::vector<uint8_t>> counted_;
  bool expect_ = false;
  bool counting_ = false;
  bool per_param_ = false;
  bool timing_ = false;
  std::vector<double> stamps_;
};

// The forward's side: which bucket the forward has reached.  Python arms it after step() (the updates wait for
// their buckets' modules) and reaches buckets through `reach`; the module hooks are GateHook objects.
class ForwardGate {
 public:
  explicit ForwardGate(WeakCall reach) : reach_(std::move(reach)) {}

  void arm(int64_t reached) {
    reached_ = reached;
    armed_ = true;
  }
  void disarm() { armed_ = false; }
  bool armed() const { return armed_; }
  int64_t reached() const { return reached_; }
  void set_reached(int64_t b) { reached_ = b; }

  void module_reached(int64_t bucket) {
    if (armed_ && bucket > reached_) {
      reach_(bucket);  // (called with the GIL: module hooks run in Python's forward)
    }
  }

 private:
  WeakCall reach_;
  int64_t reached_ = -1;
  bool armed_ = false;
};

// One module's forward pre-hook: `hook(module, args)` returns None.
class GateHook {
 public:
  GateHook(std::shared_ptr<ForwardGate> gate, int64_t bucket) : gate_(std::move(gate)), bucket_(bucket) {}
  py::object call(const py::args& /*args*/) {
    if (auto gate = gate_.lock()) gate->module_reached(bucket_);
    return py::none();
  }
  int64_t bucket() const { return bucket_; }

 private:
  std::weak_ptr<ForwardGate> gate_;
  int64_t bucket_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dearopt's gradient-ready hooks in C++ (see csrc/ready.cpp)";
  py::class_<WeakCall>(m, "WeakCall")
      .def(py::init<const py::object&, const std::string&, py::object>(), py::arg("owner"), py::arg("name"),
           py::arg("on_error") = py::none())
      .def("__call__", [](const WeakCall& w, int64_t b) { w(b); }, py::arg("b") = -1);
  py::class_<ReadyHooks, std::shared_ptr<ReadyHooks>>(m, "ReadyHooks")
      .def(py::init<WeakCall, WeakCall, WeakCall>(), py::arg("on_first"), py::arg("on_bucket"), py::arg("on_param"))
      .def("add", &ReadyHooks::add, py::arg("params"))
      .def("bind", &ReadyHooks::bind, py::arg("slots"), py::arg("buckets"), py::arg("positions"), py::arg("views"),
           py::arg("sizes"))
      .def("unbind", &ReadyHooks::unbind)
      .def("expect_backward", &ReadyHooks::expect_backward)
      .def("begin_pass", &ReadyHooks::begin_pass)
      .def("pause", &ReadyHooks::pause)
      .def("per_param", &ReadyHooks::per_param, py::arg("on"))
      .def("timing", &ReadyHooks::timing, py::arg("on"))
      .def("stamps", &ReadyHooks::stamps)
      .def("counted", &ReadyHooks::counted, py::arg("bucket"))
      .def("ready", &ReadyHooks::ready, py::arg("bucket"))
      .def("sparse_slots", &ReadyHooks::sparse_slots)
      .def("size", &ReadyHooks::size)
      .def("remove", &ReadyHooks::remove);
  py::class_<ForwardGate, std::shared_ptr<ForwardGate>>(m, "ForwardGate")
      .def(py::init<WeakCall>(), py::arg("reach"))
      .def("arm", &ForwardGate::arm, py::arg("reached"))
      .def("disarm", &ForwardGate::disarm)
      .def_property_readonly("armed", &ForwardGate::armed)
      .def_property("reached", &ForwardGate::reached, &ForwardGate::set_reached)
      .def("hook", [](std::shared_ptr<ForwardGate> gate, int64_t bucket) { return GateHook(gate, bucket); },
           py::arg("bucket"));
  // A copy of the model (an EMA model, torch.save(model)) gets an inert hook: it reaches no engine.
  py::class_<GateHook>(m, "GateHook")
      .def("__call__", &GateHook::call)
      .def_property_readonly("bucket", &GateHook::bucket)
      .def("__deepcopy__", [](const GateHook& h, py::dict) { return GateHook(nullptr, h.bucket()); })
      .def("__copy__", [](const GateHook& h) { return GateHook(nullptr, h.bucket()); })
      .def(py::pickle([](const GateHook& h) { return py::make_tuple(h.bucket()); },
                      [](py::tuple t) { return GateHook(nullptr, t[0].cast<int64_t>()); }));
}
