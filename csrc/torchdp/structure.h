#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

// Note [Nested scatter and gather]
// The one nested-structure engine of the C++ API, over c10::IValue: the tensors inside tuples
// (named ones keep their type), lists and dicts are split along `dim` as torch.chunk splits them,
// through the differentiable autograd::scatter, and joined back through autograd::gather. Like
// torch.nn.parallel.scatter, a container gives as many values as its tensor-holding member with
// the fewest chunks (a batch smaller than the device list runs fewer replicas); anything else
// (numbers, strings, None, objects) goes to every replica as it is, and containers are rebuilt
// per replica. Unlike Python, an empty container does not cut the replicas to zero: it holds no
// tensor, so every replica gets an empty one. Gather joins tensors, keeps None, and keeps any
// other value that every replica returned alike (Python fails on those). One walk each way:
// for_each_tensor flattens a value into its tensors, map_tensors rebuilds it around new ones
// (scatter splits the flat list, as the step engine does: Note [The step engine]).

namespace torchdp {

/// Splits every tensor inside `input` along `dim` over `devices` (Note [Nested scatter and
/// gather]): one value per replica, each of `input`'s shape, its tensors on devices[i]; as many as
/// the fewest chunks of any tensor, or one per device when `input` holds no tensor.
/// Differentiable: gradients of the chunks flow back to `input`'s tensors.
///
///   auto parts = torchdp::scatter(c10::IValue(std::make_tuple(x, y)), devices);
std::vector<c10::IValue> scatter(const c10::IValue& input, const std::vector<c10::Device>& devices,
                                 int64_t dim = 0);

/// Joins per-replica values of one shape into one on `destination`: tensors concatenated along
/// `dim` (0-dim ones stacked into a vector, with a warning, as Python's Gather), containers joined
/// member by member, None kept, other values kept when every replica returned the same one.
/// Mismatched shapes raise a c10::ValueError naming the member. Differentiable. With `pad_value`,
/// tensors that differ in a dimension other than `dim` (generated sequences of different lengths)
/// are padded at its end to the largest size first (autograd::gather).
///
///   auto tokens = torchdp::gather(outputs, devices[0], 0, /*pad_value=*/pad_token_id);
c10::IValue gather(const std::vector<c10::IValue>& outputs, c10::Device destination,
                   int64_t dim = 0, const std::optional<at::Scalar>& pad_value = std::nullopt);

namespace detail {

// Which C++ types torchdp converts to a c10::IValue to split or join (IsStructure), and which
// merely name a tensor somewhere inside (MentionsTensor), for the static_asserts of the typed API.
template <typename T, typename = void>
struct IsStructure : std::false_type {};
template <>
struct IsStructure<at::Tensor> : std::true_type {};
template <>
struct IsStructure<c10::IValue> : std::true_type {};
template <>
struct IsStructure<int64_t> : std::true_type {};
template <>
struct IsStructure<double> : std::true_type {};
template <>
struct IsStructure<bool> : std::true_type {};
template <>
struct IsStructure<std::string> : std::true_type {};
template <typename T>
struct IsStructure<std::vector<T>> : IsStructure<T> {};
template <typename T>
struct IsStructure<c10::List<T>> : IsStructure<T> {};
template <typename T>
struct IsStructure<std::optional<T>> : IsStructure<T> {};
template <typename... T>
struct IsStructure<std::tuple<T...>> : std::bool_constant<(IsStructure<T>::value && ...)> {};
template <typename K, typename V>
struct IsStructure<c10::Dict<K, V>>
    : std::bool_constant<(std::is_same_v<K, std::string> || std::is_same_v<K, int64_t>) &&
                         IsStructure<V>::value> {};

template <typename T>
struct MentionsTensor : std::false_type {};
template <>
struct MentionsTensor<at::Tensor> : std::true_type {};
template <>
struct MentionsTensor<c10::IValue> : std::true_type {};
template <typename T>
struct MentionsTensor<std::vector<T>> : MentionsTensor<T> {};
template <typename T>
struct MentionsTensor<c10::List<T>> : MentionsTensor<T> {};
template <typename T>
struct MentionsTensor<std::optional<T>> : MentionsTensor<T> {};
template <typename T>
struct MentionsTensor<std::list<T>> : MentionsTensor<T> {};
template <typename T>
struct MentionsTensor<std::deque<T>> : MentionsTensor<T> {};
template <typename T>
struct MentionsTensor<c10::ArrayRef<T>> : MentionsTensor<T> {};
template <typename T, size_t N>
struct MentionsTensor<std::array<T, N>> : MentionsTensor<T> {};
template <typename A, typename B>
struct MentionsTensor<std::pair<A, B>>
    : std::bool_constant<MentionsTensor<A>::value || MentionsTensor<B>::value> {};
template <typename... T>
struct MentionsTensor<std::tuple<T...>> : std::bool_constant<(MentionsTensor<T>::value || ...)> {};
template <typename K, typename V, typename... Rest>
struct MentionsTensor<std::map<K, V, Rest...>> : MentionsTensor<V> {};
template <typename K, typename V, typename... Rest>
struct MentionsTensor<std::unordered_map<K, V, Rest...>> : MentionsTensor<V> {};
template <typename K, typename V>
struct MentionsTensor<c10::Dict<K, V>> : MentionsTensor<V> {};

/// A C++ value that the structure engine splits: a structure with a tensor type inside.
template <typename T>
constexpr bool kScattered = IsStructure<T>::value && MentionsTensor<T>::value;

/// How names of values read in error messages: `root` for the whole value, or, with
/// `arguments`, "<root> k" for member k of the top tuple ("forward argument 1[0]['x']").
struct ValueNames {
  std::string root = "the input";
  bool arguments = false;
};

/// Splits each of `tensors` along `dim` over `devices` (torch.chunk's split, differentiable):
/// chunks[k] for tensor k. Errors name `api` and the tensor as `name(k)`, the dim followed by
/// `dim_note` (where it came from).
std::vector<std::vector<at::Tensor>> scatter_tensors(const std::vector<at::Tensor>& tensors,
                                                     const std::vector<c10::Device>& devices,
                                                     int64_t dim, const char* api,
                                                     const std::function<std::string(size_t)>& name,
                                                     const char* dim_note = "");

/// Refuses a tensor that cannot be split along `dim` (undefined, 0-dim, dim out of range),
/// naming `api` and the tensor as `name`, the dim followed by `dim_note`.
void check_splittable(const at::Tensor& t, const std::string& name, int64_t dim, const char* api,
                      const char* dim_note = "");

/// scatter() naming `api` and the values as `names` say in its errors.
std::vector<c10::IValue> scatter_value(const c10::IValue& input,
                                       const std::vector<c10::Device>& devices, int64_t dim,
                                       const char* api, const ValueNames& names);

/// gather() naming `api` and the values as `names` say in its errors.
c10::IValue gather_value(const std::vector<c10::IValue>& outputs, c10::Device destination,
                         int64_t dim, const char* api, const ValueNames& names,
                         const std::optional<at::Scalar>& pad_value = std::nullopt);

/// `value` with every tensor inside moved to `device` (differentiable; containers rebuilt only
/// when a tensor moved). Undefined tensors raise naming `api`.
c10::IValue to_device(const c10::IValue& value, c10::Device device, const char* api,
                      const ValueNames& names);

/// Calls `fn(tensor, name)` for every tensor inside `value`, in order; `name()` makes its
/// name for a message.
void for_each_tensor(
    const c10::IValue& value, const ValueNames& names,
    const std::function<void(const at::Tensor&, const std::function<std::string()>&)>& fn);

/// The tensors inside `value`, in order.
std::vector<at::Tensor> tensors_of(const c10::IValue& value);

/// `value` with its tensor k (for_each_tensor's order) replaced by `fn(k, tensor)`: the way back
/// from a flat list of tensors. Containers are rebuilt (named tuples keep their type) unless, with
/// `keep_unchanged`, none of their tensors changed; other values are kept as they are.
c10::IValue map_tensors(const c10::IValue& value,
                        const std::function<at::Tensor(size_t, const at::Tensor&)>& fn,
                        bool keep_unchanged);

/// The name of tensor k of `value` (for_each_tensor's order), for an error message.
std::string tensor_name(const c10::IValue& value, const ValueNames& names, size_t k);

} // namespace detail

/// Typed form: `input` is a tensor, or a std::vector, std::tuple, c10::List, c10::Dict (string or
/// int keys) or std::optional of those (numbers and strings may sit beside the tensors).
///
///   std::vector<std::tuple<at::Tensor, at::Tensor>> parts =
///       torchdp::scatter(std::make_tuple(x, y), devices);
template <typename T, typename = std::enable_if_t<!std::is_same_v<T, c10::IValue>>>
std::vector<T> scatter(const T& input, const std::vector<c10::Device>& devices, int64_t dim = 0) {
  static_assert(detail::IsStructure<T>::value,
                "torchdp::scatter: the input must be at::Tensor, or std::vector, std::tuple, "
                "c10::List, c10::Dict or std::optional of tensors (numbers and strings may sit "
                "beside them); convert other containers (std::array, std::pair, std::map) to one "
                "of these");
  auto parts = scatter(c10::IValue(input), devices, dim);
  std::vector<T> out;
  out.reserve(parts.size());
  for (auto& p : parts) {
    out.push_back(std::move(p).to<T>());
  }
  return out;
}

/// Typed form of gather(): the replicas' outputs of one C++ type joined into one.
template <typename T, typename = std::enable_if_t<!std::is_same_v<T, c10::IValue>>>
T gather(const std::vector<T>& outputs, c10::Device destination, int64_t dim = 0,
         const std::optional<at::Scalar>& pad_value = std::nullopt) {
  static_assert(detail::IsStructure<T>::value,
                "torchdp::gather: the outputs must be at::Tensor, or std::vector, std::tuple, "
                "c10::List, c10::Dict or std::optional of tensors (numbers and strings may sit "
                "beside them); convert other containers to one of these");
  std::vector<c10::IValue> values;
  values.reserve(outputs.size());
  for (const auto& o : outputs) {
    values.emplace_back(o);
  }
  return gather(values, destination, dim, pad_value).to<T>();
}

} // namespace torchdp
