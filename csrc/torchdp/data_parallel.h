#pragma once

#include <torchdp/autograd.h>
#include <torchdp/graphed_replicas.h>
#include <torchdp/devices.h>
#include <torchdp/errors.h>
#include <torchdp/parallel_apply.h>
#include <torchdp/process_group.h>
#include <torchdp/replicate.h>

#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchdp {

/// Options of torchdp::DataParallel. `device_ids`, `output_device` and `cuda_graphs` are read when
/// the DataParallel is made (changing them later in `DataParallelImpl::options` makes the next
/// forward fail, naming the option: make a new DataParallel instead); `dim`, `place_module` and
/// `bucket_cap_mb` are read at every forward.
struct DataParallelOptions {
  /// The devices to run on. Default: every visible CUDA device; with none, DataParallel calls the
  /// wrapped module directly (as torch.nn.DataParallel does without an accelerator). CPU and meta
  /// device lists run the full machinery (a device may repeat: {kCPU, kCPU} gives two replicas).
  TORCH_ARG(std::optional<std::vector<c10::Device>>, device_ids) = std::nullopt;
  /// Where the gathered output goes. Default: device_ids[0].
  TORCH_ARG(std::optional<c10::Device>, output_device) = std::nullopt;
  /// The dimension inputs are split along and outputs joined along.
  TORCH_ARG(int64_t, dim) = 0;
  /// When the module is not on device_ids[0] at a forward, move it there (module->to(device))
  /// instead of raising an error.
  TORCH_ARG(bool, place_module) = false;
  /// Size in MiB of the gradient buckets reduced while the backward pass runs (as DDP's
  /// bucket_cap_mb; 0: one bucket, reduced at the end; the first bucket, holding the last
  /// parameters, is at most 1 MiB, as DDP's). Default: 25.
  TORCH_ARG(std::optional<double>, bucket_cap_mb) = std::nullopt;
  /// Keep the replicas between forwards and replay each replica's forward and backward as CUDA
  /// graphs, captured once per input signature (up to 8; others run eagerly). For modules bound
  /// by the CPU (many small layers); the forward must be capturable (no synchronisation with the
  /// CPU, no data-dependent shapes). CUDA devices only, in builds with TORCHDP_WITH_CUDA. See
  /// Note [Graphed replicas] in torchdp/graphed_replicas.h.
  TORCH_ARG(bool, cuda_graphs) = false;
#if TORCHDP_WITH_C10D
  /// Average the gradients over the processes of this c10d group after each backward pass, as
  /// DistributedDataParallel does (one process per host, each driving its own devices). At the
  /// first forward every process takes group rank 0's parameters and buffers (the modules must
  /// match); the backward pass of a forward with grad mode on, outside no_sync(), then leaves
  /// every parameter's grad averaged over the group (a parameter without a gradient in this
  /// process takes part with zeros; one without a gradient in every process keeps none, as with
  /// DDP). Every process must run the same forwards and backward
  /// passes. Not with cuda_graphs. Read at every forward. See Note [Reducing across processes]
  /// in torchdp/process_group.cpp. Default: none.
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group);
  /// With a process_group, every forward with grad mode on (outside no_sync()) first copies
  /// group rank 0's buffers to the other processes, as DistributedDataParallel does.
  TORCH_ARG(bool, broadcast_buffers) = true;
#endif
};

class DataParallelImpl;

namespace detail {

// True when `&Impl::forward` names one function, which AnyModule needs to learn the signature.
template <typename Impl, typename = void>
struct HasConcreteForward : std::false_type {};
template <typename Impl>
struct HasConcreteForward<Impl, std::void_t<decltype(&Impl::forward)>> : std::true_type {};

// Note [Modules with a templated forward]
// torch::nn::Sequential (and any module whose forward is a template) cannot go into an AnyModule,
// which needs one concrete forward. DataParallel then holds the module itself as usual (it is
// registered, cloned and replicated like any other) and calls each replica through this adaptor,
// whose forward takes one tensor and returns one tensor. The adaptor is not a child of anything:
// it only forwards the call.
template <typename Impl>
struct TensorForward : torch::nn::Module {
  explicit TensorForward(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  at::Tensor forward(at::Tensor input) {
    return impl_->forward(std::move(input));
  }
  std::shared_ptr<Impl> impl_;
};

// The checks of DataParallel's options and module, made once here for both front ends: the C++
// DataParallelImpl and the Python wrapper (torchdp/data_parallel.py, through torchdp._C).

/// A process group and CUDA graphs together are refused (c10::ValueError).
void check_group_and_graphs(bool process_group, bool cuda_graphs, const char* api);

/// CUDA graphs need CUDA devices (c10::ValueError) and a build with the CUDA fast paths.
void check_cuda_graphs(const std::vector<c10::Device>& devices, const char* api);

/// The error for a module that is not on device_ids[0]: its `kind` ("parameter" or "buffer")
/// `name` was found on `found`; `fix` (the front end's words) ends it.
std::string misplaced_module_message(c10::Device target, const std::string& kind,
                                     const std::string& name, c10::Device found,
                                     const std::string& fix);

} // namespace detail

/// While it lives, the forwards of a DataParallel do not average their gradients over its
/// process_group in their backward pass (gradient accumulation, as DDP's no_sync()); the first
/// backward of a forward after it averages everything accumulated. See DataParallelImpl::no_sync.
class NoSync {
 public:
  explicit NoSync(DataParallelImpl& dp);
  ~NoSync();
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;

 private:
  DataParallelImpl& dp_;
  bool previous_;
};

/// Data parallelism over the devices of one process, as a module: every forward splits its tensor
/// arguments along `dim` over the devices, runs one replica of the wrapped module per chunk in
/// parallel, and joins the outputs on `output_device`. Gradients of all replicas are summed into
/// the wrapped module's parameters. Replicas are cached and refreshed, not rebuilt, between
/// forwards (see Note [Replicating Modules]); the wrapped module and its submodules must be
/// Cloneable.
///
/// The wrapped module is registered as the child "module", so parameters(), to(), train() and
/// serialization go through it, and its parameters and buffers must be on device_ids[0] at each
/// forward (or set place_module). With a single device, the module runs directly (no replication)
/// and the output is moved to output_device.
///
/// Example::
///
///   torchdp::DataParallel model(Net(), torchdp::DataParallelOptions().device_ids(
///       std::vector<torch::Device>{torch::kCUDA, torch::Device("cuda:1")}));
///   auto loss = model->forward(x).pow(2).mean();
///   loss.backward();
class DataParallelImpl : public torch::nn::Module {
 public:
  /// Wraps `module` (a holder such as `torch::nn::Linear` or a `std::shared_ptr<Impl>`). A module
  /// whose forward is a template, such as `torch::nn::Sequential`, is called with one tensor and
  /// must return one (Note [Modules with a templated forward]).
  template <typename ModuleType>
  explicit DataParallelImpl(ModuleType module, DataParallelOptions options = {})
      : options(std::move(options)) {
    using Impl = typename std::decay_t<decltype(*module)>;
    std::shared_ptr<Impl> ptr = as_shared(module);
    init(ptr, [](const std::shared_ptr<torch::nn::Module>& m) {
      if constexpr (detail::HasConcreteForward<Impl>::value) {
        return torch::nn::AnyModule(std::static_pointer_cast<Impl>(m));
      } else {
        return torch::nn::AnyModule(
            std::make_shared<detail::TensorForward<Impl>>(std::static_pointer_cast<Impl>(m)));
      }
    });
  }

  /// Runs the data-parallel forward over one or more tensor arguments; returns the gathered output.
  template <typename... Tensors>
  at::Tensor forward(const Tensors&... inputs) {
    static_assert(sizeof...(Tensors) > 0,
                  "torchdp::DataParallel::forward needs at least one tensor");
    static_assert((std::is_convertible_v<Tensors, at::Tensor> && ...),
                  "torchdp::DataParallel::forward takes tensor arguments only");
    std::shared_ptr<BufferSnapshot> buffers; // Note [Buffers of failed forwards]
    auto outputs = run({at::Tensor(inputs)...}, make_call<Tensors...>(), &buffers);
    return join(std::move(outputs), buffers);
  }

  /// The same forward without the gather: one output per replica, each on its replica's device
  /// (one element when DataParallel passes through or runs on one device). Compute the loss per
  /// replica with torchdp::parallel_loss so that output_device never holds the whole batch's
  /// outputs (memory balance).
  template <typename... Tensors>
  std::vector<at::Tensor> forward_replicas(const Tensors&... inputs) {
    static_assert(sizeof...(Tensors) > 0,
                  "torchdp::DataParallel::forward_replicas needs at least one tensor");
    static_assert((std::is_convertible_v<Tensors, at::Tensor> && ...),
                  "torchdp::DataParallel::forward_replicas takes tensor arguments only");
    return run({at::Tensor(inputs)...}, make_call<Tensors...>());
  }

  /// The devices in use (empty when DataParallel passes through to the module).
  const std::vector<c10::Device>& device_ids() const {
    return device_ids_;
  }
  /// Where outputs are gathered (nullopt when passing through).
  std::optional<c10::Device> output_device() const {
    return output_device_;
  }
  int64_t dim() const {
    return options.dim();
  }
  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& module() const {
    return module_;
  }
  /// The replica cache (skeleton_builds(), invalidate()).
  Replicator& replicator() {
    return *replicator_;
  }
  /// With options.cuda_graphs: how many input signatures were captured as CUDA graphs so far.
  int64_t graph_captures() const;

  /// Gradient accumulation with a process_group: forwards made while the returned guard lives
  /// do not average their gradients in their backward pass.
  ///
  ///   {
  ///     auto guard = model->no_sync();
  ///     model->forward(x1).sum().backward();   // accumulates only
  ///   }
  ///   model->forward(x2).sum().backward();     // averages everything accumulated
  [[nodiscard]] std::unique_ptr<NoSync> no_sync() {
    return std::make_unique<NoSync>(*this);
  }
  /// False while a no_sync() guard lives.
  bool require_backward_grad_sync() const {
    return require_backward_grad_sync_;
  }

  void pretty_print(std::ostream& stream) const override;

  DataParallelOptions options;

 private:
  using Call = std::function<at::Tensor(torch::nn::AnyModule&, std::vector<at::Tensor>&)>;
  using Wrap = std::function<torch::nn::AnyModule(const std::shared_ptr<torch::nn::Module>&)>;

  template <typename T>
  static std::shared_ptr<T> as_shared(const std::shared_ptr<T>& p) {
    return p;
  }
  template <typename T>
  static std::shared_ptr<T> as_shared(const torch::nn::ModuleHolder<T>& h) {
    return h.ptr();
  }
  template <size_t... I>
  static at::Tensor call(torch::nn::AnyModule& m, std::vector<at::Tensor>& args,
                         std::index_sequence<I...>) {
    return m.forward(args[I]...);
  }
  template <typename... Tensors>
  static Call make_call() {
    return [](torch::nn::AnyModule& m, std::vector<at::Tensor>& args) {
      return call(m, args, std::index_sequence_for<Tensors...>{});
    };
  }

  void init(std::shared_ptr<torch::nn::Module> module, Wrap wrap);
  // Fails when an option read at construction was changed since (see DataParallelOptions).
  void check_fixed_options() const;
  // Checks (or, with place_module, makes) that the module is on device_ids[0]; returns its
  // buffers.
  std::vector<at::Tensor> ensure_placement();
  // The per-replica outputs (one when passing through or on one device, already on
  // output_device then).
  // A replicated forward first copies the module's buffers and writes them back when it fails
  // (Note [Buffers of failed forwards]); the copy is handed out through `buffers` when given.
  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs, const Call& call,
                              std::shared_ptr<BufferSnapshot>* buffers = nullptr);
  // run() without the process group's part; `originals`: the module's buffers, as
  // ensure_placement() returned them (empty when passing through).
  std::vector<at::Tensor> run_here(std::vector<at::Tensor> inputs, const Call& call,
                                   const std::vector<at::Tensor>& originals,
                                   std::shared_ptr<BufferSnapshot>* buffers);
  // run() through the graphed replicas (empty when this forward runs eagerly).
  std::vector<at::Tensor> run_graphed(const std::vector<std::vector<at::Tensor>>& chunks,
                                      const Call& call);
  // The gathered output of run()'s outputs; when the gather fails, run()'s buffer copy is written
  // back.
  at::Tensor join(std::vector<at::Tensor> outputs,
                  const std::shared_ptr<BufferSnapshot>& buffers) const;

  std::shared_ptr<torch::nn::Module> module_;
  torch::nn::AnyModule any_;
  Wrap wrap_;
  std::unique_ptr<Replicator> replicator_;
  std::shared_ptr<detail::GraphedReplicas> graphed_;
  // The buffer copy of the last forward, refreshed in place by the next (run()).
  std::shared_ptr<BufferSnapshot> buffer_snapshot_;
  std::vector<c10::Device> device_ids_;
  std::optional<c10::Device> output_device_;
  // The options read at construction, as given then (check_fixed_options).
  DataParallelOptions constructed_;
  bool require_backward_grad_sync_ = true;
#if TORCHDP_WITH_C10D
  std::shared_ptr<detail::ProcessGroupSync> sync_;
#endif
  friend class NoSync;
};

/// A `ModuleHolder` for DataParallelImpl (see its documentation).
TORCH_MODULE(DataParallel);

/// How parallel_loss combines the per-replica losses.
enum class LossReduction {
  Mean, ///< average weighted by each chunk's number of samples (the whole-batch mean)
  Sum,  ///< sum of the replicas' losses
};

/// The loss per replica, for memory balance: splits `target` along `dim` as DataParallel splits its
/// inputs (`target.chunk(outputs.size(), dim)`), moves chunk i to outputs[i]'s device, computes
/// `loss_fn(outputs[i], chunk_i)` there (a 0-dim tensor), and combines the losses on
/// `output_device` (default: outputs[0]'s device); only scalars travel between devices.
/// Differentiable. With `LossReduction::Mean` and a loss_fn that averages over its samples, the
/// result is the whole-batch mean.
///
///   auto outputs = model->forward_replicas(x);   // model: torchdp::DataParallel
///   auto loss = torchdp::parallel_loss(outputs, y, [](const at::Tensor& out, const at::Tensor& t)
///   {
///     return torch::nn::functional::cross_entropy(out, t);
///   });
///   loss.backward();
at::Tensor parallel_loss(
    const std::vector<at::Tensor>& outputs, const at::Tensor& target,
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss_fn,
    LossReduction reduction = LossReduction::Mean, int64_t dim = 0,
    std::optional<c10::Device> output_device = std::nullopt);

/// Drop-in for torch::nn::parallel::data_parallel, with the same signature and results: splits
/// `input` along `dim` over `devices` (default: all CUDA devices), runs a replica of `module` per
/// chunk in parallel and gathers the outputs on `output_device` (default: devices[0]). With one
/// device, the module is moved there and called directly. Unlike LibTorch's version, replicas are
/// cached and refreshed instead of deep-cloned on every call, and gradients are reduced coalesced.
template <typename ModuleType>
at::Tensor data_parallel(ModuleType module, at::Tensor input,
                         std::optional<std::vector<c10::Device>> devices = std::nullopt,
                         std::optional<c10::Device> output_device = std::nullopt, int64_t dim = 0) {
  constexpr const char* api = "torchdp::data_parallel";
  auto used = devices ? normalize_devices(*devices, api) : default_devices(api);
  const auto out_device = output_device ? normalize_device(*output_device, api) : used.front();
  if (used.size() == 1) {
    module->to(used.front());
    return module->forward(input.to(used.front())).to(out_device);
  }
  std::vector<at::Tensor> chunks;
  try {
    chunks = autograd::scatter(input, used, std::nullopt, dim);
  } catch (...) {
    detail::rethrow_with_prefix(std::string(api) + ": "); // the input's errors, named by this API
  }
  used.resize(chunks.size(), used.front());
  BufferSnapshot buffers(module->buffers()); // Note [Buffers of failed forwards]
  try {
    auto replicas = replicate(module, used);
    auto outputs = parallel_apply(replicas, chunks, used);
    return autograd::gather(outputs, out_device, dim);
  } catch (...) {
    buffers.restore();
    throw;
  }
}

} // namespace torchdp
