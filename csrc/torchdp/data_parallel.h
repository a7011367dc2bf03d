#pragma once

#include <torchdp/autograd.h>
#include <torchdp/graphed_replicas.h>
#include <torchdp/devices.h>
#include <torchdp/errors.h>
#include <torchdp/parallel_apply.h>
#include <torchdp/process_group.h>
#include <torchdp/reduction.h>
#include <torchdp/replicate.h>
#include <torchdp/shares.h>
#include <torchdp/step.h>
#include <torchdp/structure.h>

#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace torchdp {

/// Options of torchdp::DataParallel. `device_ids`, `output_device` and `cuda_graphs` are read when
/// it is made (a later change fails the next forward); the others at every forward.
struct DataParallelOptions {
  /// The devices to run on. Default: every visible CUDA device; with none, the module is called
  /// directly, as torch.nn.DataParallel does. CPU and meta devices work and may repeat.
  TORCH_ARG(std::optional<std::vector<c10::Device>>, device_ids) = std::nullopt;
  /// Where the gathered output goes. Default: device_ids[0].
  TORCH_ARG(std::optional<c10::Device>, output_device) = std::nullopt;
  /// The dimension inputs are split along and outputs joined along.
  TORCH_ARG(int64_t, dim) = 0;
  /// Move a module that is not on device_ids[0] there at the forward instead of raising.
  TORCH_ARG(bool, place_module) = false;
  /// Size in MiB of the gradient buckets reduced during the backward pass, as DDP's
  /// bucket_cap_mb (0: one bucket, reduced at the end). Default: 25.
  TORCH_ARG(std::optional<double>, bucket_cap_mb) = std::nullopt;
  /// Replay each replica's forward and backward as CUDA graphs, captured once per input
  /// signature (up to 8; others run eagerly): for CPU-bound models with a capturable forward.
  /// CUDA devices only. Note [Graphed replicas] in torchdp/graphed_replicas.h.
  TORCH_ARG(bool, cuda_graphs) = false;
  /// Each device's share of the batch, weights ({1, 2, 2, 2}) or row counts, one per device of
  /// device_ids: the rows are divided as torchdp::share_rows() divides them and devices that get
  /// none do not run (Note [Uneven shares]); outputs and gradients stay those of one device. Not
  /// with cuda_graphs. Default: equal shares (torch.chunk's split).
  TORCH_ARG(std::optional<std::vector<double>>, shares) = std::nullopt;
  /// Split each std::vector<at::Tensor> argument by item, as a list of samples (images of
  /// different sizes): each device gets whole samples, its share of them, and a std::vector
  /// output joins them back in order (Note [Lists of samples]). Without it such an argument whose
  /// tensors cannot be one batch is refused. Not with cuda_graphs.
  TORCH_ARG(bool, samples) = false;
#if TORCHDP_WITH_C10D
  /// Average the gradients over the processes of this c10d group after each backward pass, as
  /// DistributedDataParallel does; the first forward takes rank 0's parameters and buffers.
  /// Every process runs the same steps. Not with cuda_graphs. Note [Reducing across processes].
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group);
  /// With a process_group, forwards with grad mode on first copy rank 0's buffers, as DDP's.
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

/// The decayed return and parameter types of a module's forward, for DataParallel's checks of a
/// call (AnyModule compares the same decayed types when it runs the call).
struct ForwardSignature {
  const std::type_info* output = nullptr; // null: not known
  std::vector<const std::type_info*> arguments;
};

template <typename F>
struct ForwardTraits { // other forms (ref-qualified forwards): not checked
  static ForwardSignature get() {
    return {};
  }
};
template <typename R, typename C, typename... A>
struct ForwardTraits<R (C::*)(A...)> {
  static ForwardSignature get() {
    return {&typeid(std::decay_t<R>), {&typeid(std::decay_t<A>)...}};
  }
};
template <typename R, typename C, typename... A>
struct ForwardTraits<R (C::*)(A...) const> : ForwardTraits<R (C::*)(A...)> {};
template <typename R, typename C, typename... A>
struct ForwardTraits<R (C::*)(A...) noexcept> : ForwardTraits<R (C::*)(A...)> {};
template <typename R, typename C, typename... A>
struct ForwardTraits<R (C::*)(A...) const noexcept> : ForwardTraits<R (C::*)(A...)> {};

// Note [Arguments of the structured forward]
// DataParallel::forward splits the tensors inside each argument whose type is a structure with a
// tensor in it (detail::kScattered: at::Tensor, std::vector, std::tuple, c10::List, c10::Dict,
// std::optional of those): they travel as one c10::IValue tuple through the structure engine and
// are converted back for each replica. Every other argument is copied to each replica as it is
// (AnyModule keeps its own copy); its slot in the tuple holds None.
template <typename Arg>
c10::IValue pack_argument(const Arg& arg) {
  if constexpr (kScattered<Arg>) {
    return c10::IValue(arg);
  } else {
    return c10::IValue();
  }
}

template <typename... Args>
c10::IValue pack_arguments(const Args&... args) {
  return c10::ivalue::Tuple::create(std::vector<c10::IValue>{pack_argument(args)...});
}

template <typename Arg>
decltype(auto) argument_of(const c10::IValue& part, const Arg& original) {
  if constexpr (kScattered<Arg>) {
    return part.to<Arg>();
  } else {
    return original; // a const reference: AnyModule copies it for the replica
  }
}

template <typename Arg>
constexpr void check_argument_type() {
  static_assert(IsStructure<Arg>::value || !MentionsTensor<Arg>::value,
                "torchdp::DataParallel::forward: an argument holds tensors in a type that "
                "torchdp cannot split; use at::Tensor, std::vector, std::tuple, c10::List, "
                "c10::Dict (string or int keys) or std::optional of tensors, numbers and strings "
                "(std::array, std::pair, std::map, std::list and c10::ArrayRef are not)");
  static_assert(std::is_copy_constructible_v<Arg>,
                "torchdp::DataParallel::forward: an argument that is not split is copied to every "
                "replica, so its type must be copyable; pass a std::shared_ptr to share one "
                "object");
}

template <typename Output>
constexpr void check_output_type() {
  static_assert(IsStructure<Output>::value && !std::is_same_v<Output, c10::IValue>,
                "torchdp::DataParallel::forward<Output>: Output must be the module's forward's "
                "return type, and one that gather can join: at::Tensor, std::vector, std::tuple, "
                "c10::List, c10::Dict or std::optional of tensors (numbers and strings may sit "
                "beside them)");
}

// Note [Modules with a templated forward]
// An AnyModule needs one concrete forward, which torch::nn::Sequential lacks: such a module is
// held, cloned and replicated as usual, and each replica is called through this tensor-to-tensor
// adaptor, which is not a child of anything.
template <typename Impl>
struct TensorForward : torch::nn::Module {
  explicit TensorForward(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  at::Tensor forward(at::Tensor input) {
    return impl_->forward(std::move(input));
  }
  std::shared_ptr<Impl> impl_;
};

// DataParallel's checks, for both front ends (the Python wrapper calls them through torchdp._C).

/// A process group and CUDA graphs together are refused (c10::ValueError).
void check_group_and_graphs(bool process_group, bool cuda_graphs, const char* api);

/// The error for a module that is not on device_ids[0]: its `kind` ("parameter" or "buffer")
/// `name` was found on `found`; `fix` (the front end's words) ends it.
std::string misplaced_module_message(c10::Device target, const std::string& kind,
                                     const std::string& name, c10::Device found,
                                     const std::string& fix);

} // namespace detail

/// While it lives, forwards do not average their gradients over the process_group (gradient
/// accumulation, as DDP's no_sync()). See DataParallelImpl::no_sync.
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

/// Data parallelism over the devices of one process: each forward splits its tensor arguments
/// along `dim`, runs one replica per chunk in parallel and gathers the outputs on `output_device`;
/// gradients are summed into the wrapped module, which must be Cloneable and on device_ids[0].
/// Replicas are refreshed, not rebuilt, between forwards (Note [Replicating Modules]). The module
/// is the child "module"; on one device it runs directly.
///
/// Example::
///
///   torchdp::DataParallel model(Net(), torchdp::DataParallelOptions().device_ids(
///       std::vector<torch::Device>{torch::kCUDA, torch::Device("cuda:1")}));
///   auto loss = model->forward(x).pow(2).mean();
///   loss.backward();
class DataParallelImpl : public torch::nn::Module {
 public:
  /// Wraps `module` (a holder or a `std::shared_ptr<Impl>`); a templated forward such as
  /// Sequential's takes and returns one tensor (Note [Modules with a templated forward]).
  template <typename ModuleType>
  explicit DataParallelImpl(ModuleType module, DataParallelOptions options = {})
      : options(std::move(options)) {
    using Impl = typename std::decay_t<decltype(*module)>;
    std::shared_ptr<Impl> ptr = as_shared(module);
    if constexpr (detail::HasConcreteForward<Impl>::value) {
      signature_ = detail::ForwardTraits<decltype(&Impl::forward)>::get();
    } else {
      signature_ = detail::ForwardSignature{&typeid(at::Tensor), {&typeid(at::Tensor)}};
    }
    init(ptr, [](const std::shared_ptr<torch::nn::Module>& m) {
      if constexpr (detail::HasConcreteForward<Impl>::value) {
        return torch::nn::AnyModule(std::static_pointer_cast<Impl>(m));
      } else {
        return torch::nn::AnyModule(
            std::make_shared<detail::TensorForward<Impl>>(std::static_pointer_cast<Impl>(m)));
      }
    });
  }

  /// Runs the data-parallel forward; returns the gathered output, of type `Output`: the module's
  /// forward's return type (at::Tensor, or std::tuple / std::vector / c10::Dict of tensors...).
  /// Tensors are split along dim, also inside std::vector, std::tuple, c10::List, c10::Dict and
  /// std::optional arguments; any other argument (a number, a string, an options struct) is
  /// copied to every replica (Note [Arguments of the structured forward]).
  ///
  ///   auto out = dp->forward(x, y);                                  // returns a Tensor
  ///   auto [logits, aux] = dp->forward<std::tuple<at::Tensor, at::Tensor>>(x, 0.5);
  template <typename Output = at::Tensor, typename... Args>
  Output forward(const Args&... inputs) {
    static_assert(sizeof...(Args) > 0,
                  "torchdp::DataParallel::forward needs at least one argument");
    std::shared_ptr<BufferSnapshot> buffers; // Note [Buffers of failed forwards]
    auto outputs = run_typed<Output>(&buffers, inputs...);
    if constexpr (kTensorForward<Output, Args...>) {
      return join(std::move(outputs), buffers);
    } else {
      return step_
          .join(std::move(outputs), device_ids_.size(), output_device_, options.dim(), buffers,
                options.samples())
          .template to<Output>();
    }
  }

  /// The forward without the gather: one output per replica, on its device; pair it with
  /// torchdp::parallel_loss so that output_device never holds the whole batch's outputs.
  /// Arguments and `Output` as forward()'s.
  template <typename Output = at::Tensor, typename... Args>
  std::vector<Output> forward_replicas(const Args&... inputs) {
    static_assert(sizeof...(Args) > 0,
                  "torchdp::DataParallel::forward_replicas needs at least one argument");
    auto outputs = run_typed<Output>(nullptr, inputs...);
    if constexpr (kTensorForward<Output, Args...>) {
      return outputs;
    } else {
      std::vector<Output> typed;
      typed.reserve(outputs.size());
      for (auto& o : outputs) {
        typed.push_back(std::move(o).template to<Output>());
      }
      return typed;
    }
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

  /// Gradient accumulation with a process_group: forwards under the guard do not average.
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

  // One replica's call of the structured forward (Note [Arguments of the structured forward]):
  // its part of the packed arguments in, its output as a c10::IValue out.
  using StructuredCall =
      std::function<c10::IValue(torch::nn::AnyModule&, const c10::IValue& arguments)>;

  template <typename Output, typename... Args, size_t... I>
  static c10::IValue call_structured(torch::nn::AnyModule& m, const c10::IValue& packed,
                                     const std::tuple<const Args&...>& originals,
                                     std::index_sequence<I...>) {
    const auto& parts = packed.toTupleRef().elements();
    return c10::IValue(
        m.forward<Output>(detail::argument_of<Args>(parts[I], std::get<I>(originals))...));
  }
  template <typename Output, typename... Args>
  static StructuredCall make_structured_call(const Args&... inputs) {
    // References: the call runs within forward(), while the arguments live.
    return [originals = std::tuple<const Args&...>(inputs...)](torch::nn::AnyModule& m,
                                                               const c10::IValue& packed) {
      return call_structured<Output, Args...>(m, packed, originals,
                                              std::index_sequence_for<Args...>{});
    };
  }

  // The tensor forward (tensors in, a tensor out) or the structured one; their checks first.
  template <typename Output, typename... Args>
  static constexpr bool kTensorForward =
      std::is_same_v<Output, at::Tensor> && (std::is_convertible_v<Args, at::Tensor> && ...);
  template <typename Output, typename... Args>
  auto run_typed(std::shared_ptr<BufferSnapshot>* buffers, const Args&... inputs) {
    if constexpr (kTensorForward<Output, Args...>) {
      check_call(typeid(Output),
                 std::vector<const std::type_info*>(sizeof...(Args), &typeid(at::Tensor)));
      return run({at::Tensor(inputs)...}, make_call<Args...>(), buffers);
    } else {
      detail::check_output_type<Output>();
      (detail::check_argument_type<Args>(), ...);
      check_call(typeid(Output), {&typeid(Args)...});
      return run_structured(detail::pack_arguments(inputs...),
                            make_structured_call<Output>(inputs...), buffers);
    }
  }
  // Fails, before anything runs, when the module's forward does not take `arguments` (decayed
  // types) or does not return `output`.
  void check_call(const std::type_info& output,
                  const std::vector<const std::type_info*>& arguments) const;
  // The forward of tensor arguments: one output per replica; the buffer copy of Note [Buffers of
  // failed forwards] goes to `buffers` when given (join() releases it).
  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs, const Call& call,
                              std::shared_ptr<BufferSnapshot>* buffers = nullptr);
  // The structured forward: `inputs` is the packed argument tuple.
  std::vector<c10::IValue> run_structured(c10::IValue inputs, const StructuredCall& call,
                                          std::shared_ptr<BufferSnapshot>* buffers = nullptr);
  // Gathers run()'s outputs; a failed gather writes the buffer copy back.
  at::Tensor join(std::vector<at::Tensor> outputs,
                  const std::shared_ptr<BufferSnapshot>& buffers) const;
  // Both forwards over their flat tensor inputs (Note [The step engine]): `call(module, inputs,
  // split)` runs the module, or a replica on its part of the split inputs; `graph_call`, given
  // with cuda_graphs, may replay the forward instead.
  using FlatCall =
      std::function<c10::IValue(torch::nn::AnyModule&, std::vector<at::Tensor>&, bool split)>;
  using Names = std::function<std::string(size_t)>;
  // The checks of the options, the placement and the process group around run_here(); with
  // `items`, the inputs are split by item (Note [Lists of samples]).
  std::vector<c10::IValue> run_flat(std::vector<at::Tensor> inputs, const Names& names,
                                    const FlatCall& call, const Call* graph_call,
                                    std::shared_ptr<BufferSnapshot>* buffers,
                                    const detail::Items* items = nullptr);
  // The step itself: the module called directly (no devices, or one), or the step engine's
  // split, replicas and run; `originals` are the module's buffers (ensure_placement()).
  std::vector<c10::IValue> run_here(std::vector<at::Tensor> inputs, const Names& names,
                                    const FlatCall& call, const Call* graph_call,
                                    const std::vector<at::Tensor>& originals,
                                    std::shared_ptr<BufferSnapshot>* buffers,
                                    const detail::Items* items);
  // The forward through the graphed replicas (empty when this forward runs eagerly).
  std::vector<at::Tensor> run_graphed(const std::vector<std::vector<at::Tensor>>& chunks,
                                      const Call& call);

  void init(std::shared_ptr<torch::nn::Module> module, Wrap wrap);
  // Fails when an option read at construction was changed since (see DataParallelOptions).
  void check_fixed_options() const;
  void check_shares() const; // options.shares against the devices, at construction and forwards
  // Checks (or with place_module makes) the module's placement; returns its buffers.
  std::vector<at::Tensor> ensure_placement();

  std::shared_ptr<torch::nn::Module> module_;
  detail::ForwardSignature signature_;
  torch::nn::AnyModule any_;
  Wrap wrap_;
  std::unique_ptr<Replicator> replicator_;
  std::shared_ptr<detail::GraphedReplicas> graphed_;
  detail::Step step_{"torchdp::DataParallel", " (DataParallelOptions::dim)"};
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

/// The loss per replica, for memory balance: splits `target` along `dim` as the inputs were,
/// computes `loss_fn(outputs[i], chunk_i)` (a 0-dim tensor) on each output's device and combines
/// the losses on `output_device` (default: outputs[0]'s). Differentiable.
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

/// Drop-in for torch::nn::parallel::data_parallel, with the same signature and results; replicas
/// are refreshed instead of deep-cloned on every call. With one device the module runs there.
///
/// `shares` (not in LibTorch's signature) gives each device its share of the batch, as
/// DataParallelOptions::shares.
template <typename ModuleType>
at::Tensor data_parallel(ModuleType module, at::Tensor input,
                         std::optional<std::vector<c10::Device>> devices = std::nullopt,
                         std::optional<c10::Device> output_device = std::nullopt, int64_t dim = 0,
                         const std::optional<std::vector<double>>& shares = std::nullopt) {
  constexpr const char* api = "torchdp::data_parallel";
  auto used = devices ? normalize_devices(*devices, api) : default_devices(api);
  if (shares) {
    detail::check_shares(*shares, used.size(), api);
  }
  const auto out_device = output_device ? normalize_device(*output_device, api) : used.front();
  if (used.size() == 1) {
    module->to(used.front());
    return module->forward(input.to(used.front())).to(out_device);
  }
  detail::Step step(api); // Note [The step engine]
  const auto split = step.split(
      {input}, used, dim,
      [](size_t) {
        return std::string("the input");
      },
      shares);
  decltype(replicate(module, split.used)) replicas;
  std::vector<at::Tensor> outputs(split.used.size());
  std::shared_ptr<BufferSnapshot> buffers;
  step.run(
      split.used, module->buffers(), std::nullopt, &buffers,
      [&] {
        replicas = replicate(module, split.used);
      },
      [&](size_t i) {
        outputs[i] = replicas[i]->forward(split.parts[i].front()).to(split.used[i]);
      });
  return detail::Step::gather(buffers, [&] {
    return autograd::gather(outputs, out_device, dim);
  });
}

} // namespace torchdp
