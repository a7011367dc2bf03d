#include <torchdp/autograd.h>
#include <torchdp/devices.h>
#include <torchdp/errors.h>
#include <torchdp/structure.h>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <sstream>

namespace torchdp {
namespace {

constexpr const char* kScatter = "torchdp::scatter";
constexpr const char* kGather = "torchdp::gather";

// A tuple with `like`'s named-tuple type (when it has one) and new elements.
c10::IValue make_tuple_like(const c10::ivalue::Tuple& like, std::vector<c10::IValue> items) {
  const auto type = like.type();
  if (type && type->name()) {
    return c10::ivalue::Tuple::createNamed(std::move(items), type);
  }
  return c10::ivalue::Tuple::create(std::move(items));
}

// How a dict key appears in a path: strings quoted.
std::string key_text(const c10::IValue& key) {
  std::ostringstream os;
  if (key.isString()) {
    os << "'" << key.toStringRef() << "'";
  } else {
    os << key;
  }
  return os.str();
}

// Returns one value per chunk; the result may be shorter than devices (fewer chunks). `where` is
// the value's place in the input, for errors.
std::vector<c10::IValue> scatter_value(const c10::IValue& value,
                                       const std::vector<c10::Device>& devices, int64_t dim,
                                       const std::string& where) {
  const size_t n = devices.size();
  if (value.isTensor()) {
    try {
      auto chunks = autograd::scatter(value.toTensor(), devices, std::nullopt, dim);
      return std::vector<c10::IValue>(chunks.begin(), chunks.end());
    } catch (...) {
      detail::rethrow_with_prefix(std::string(kScatter) + ": input " + where + ": ");
    }
  }
  if (value.isTuple() && !value.toTupleRef().elements().empty()) {
    const auto& elements = value.toTupleRef().elements();
    std::vector<std::vector<c10::IValue>> parts;
    size_t count = n;
    for (const auto k : c10::irange(elements.size())) {
      parts.push_back(
          scatter_value(elements[k], devices, dim, where + "[" + std::to_string(k) + "]"));
      count = std::min(count, parts.back().size());
    }
    std::vector<c10::IValue> out;
    for (const auto i : c10::irange(count)) {
      std::vector<c10::IValue> items;
      items.reserve(parts.size());
      for (auto& p : parts) {
        items.push_back(p[i]);
      }
      out.emplace_back(make_tuple_like(value.toTupleRef(), std::move(items)));
    }
    return out;
  }
  if (value.isList() && !value.toListRef().empty()) {
    const auto list = value.toList();
    std::vector<std::vector<c10::IValue>> parts;
    size_t count = n;
    for (const auto i : c10::irange(list.size())) {
      parts.push_back(
          scatter_value(list.get(i), devices, dim, where + "[" + std::to_string(i) + "]"));
      count = std::min(count, parts.back().size());
    }
    std::vector<c10::IValue> out;
    for (const auto i : c10::irange(count)) {
      c10::impl::GenericList items(list.elementType());
      for (auto& p : parts) {
        items.push_back(p[i]);
      }
      out.emplace_back(std::move(items));
    }
    return out;
  }
  if (value.isGenericDict() && !value.toGenericDict().empty()) {
    const auto dict = value.toGenericDict();
    std::vector<c10::IValue> keys;
    std::vector<std::vector<c10::IValue>> parts;
    size_t count = n;
    for (const auto& entry : dict) {
      keys.push_back(entry.key());
      parts.push_back(
          scatter_value(entry.value(), devices, dim, where + "[" + key_text(entry.key()) + "]"));
      count = std::min(count, parts.back().size());
    }
    std::vector<c10::IValue> out;
    for (const auto i : c10::irange(count)) {
      c10::impl::GenericDict items(dict.keyType(), dict.valueType());
      for (const auto k : c10::irange(keys.size())) {
        items.insert(keys[k], parts[k][i]);
      }
      out.emplace_back(std::move(items));
    }
    return out;
  }
  // Anything else goes to every replica as it is (by reference for objects).
  return std::vector<c10::IValue>(n, value);
}

c10::IValue gather_value(const std::vector<c10::IValue>& outputs, c10::Device destination,
                         int64_t dim, const std::string& where) {
  const auto& first = outputs[0];
  if (first.isTensor()) {
    std::vector<at::Tensor> tensors;
    tensors.reserve(outputs.size());
    for (const auto i : c10::irange(outputs.size())) {
      TORCH_CHECK(outputs[i].isTensor(), kGather, ": output ", where,
                  " of replica 0 is a tensor but ", "replica ", i, " returned ",
                  outputs[i].tagKind());
      tensors.push_back(outputs[i].toTensor());
    }
    try {
      return autograd::gather(tensors, destination, dim);
    } catch (...) {
      detail::rethrow_with_prefix(std::string(kGather) + ": output " + where + ": ");
    }
  }
  if (first.isNone()) {
    return first;
  }
  if (first.isTuple()) {
    const size_t size = first.toTupleRef().elements().size();
    std::vector<c10::IValue> items;
    for (const auto k : c10::irange(size)) {
      std::vector<c10::IValue> column;
      for (const auto i : c10::irange(outputs.size())) {
        TORCH_CHECK(outputs[i].isTuple() && outputs[i].toTupleRef().elements().size() == size,
                    kGather, ": output ", where, " is a tuple of ", size,
                    " elements in replica 0 but not in replica ", i);
        column.push_back(outputs[i].toTupleRef().elements()[k]);
      }
      items.push_back(
          gather_value(column, destination, dim, where + "[" + std::to_string(k) + "]"));
    }
    return make_tuple_like(first.toTupleRef(), std::move(items));
  }
  if (first.isList()) {
    const size_t size = first.toListRef().size();
    c10::impl::GenericList items(first.toList().elementType());
    for (const auto k : c10::irange(size)) {
      std::vector<c10::IValue> column;
      for (const auto i : c10::irange(outputs.size())) {
        TORCH_CHECK(outputs[i].isList() && outputs[i].toListRef().size() == size, kGather,
                    ": output ", where, " is a list of ", size,
                    " elements in replica 0 but not in replica ", i);
        column.push_back(outputs[i].toListRef()[k]);
      }
      items.push_back(
          gather_value(column, destination, dim, where + "[" + std::to_string(k) + "]"));
    }
    return items;
  }
  if (first.isGenericDict()) {
    const auto dict = first.toGenericDict();
    for (const auto i : c10::irange(outputs.size())) {
      TORCH_CHECK(outputs[i].isGenericDict() && outputs[i].toGenericDict().size() == dict.size(),
                  kGather, ": all dicts must have the same number of keys, but output ", where,
                  " of replica 0 has ", dict.size(), " and replica ", i, " differs");
    }
    c10::impl::GenericDict items(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) {
      const auto key = key_text(entry.key());
      std::vector<c10::IValue> column;
      for (const auto i : c10::irange(outputs.size())) {
        const auto other = outputs[i].toGenericDict();
        auto it = other.find(entry.key());
        TORCH_CHECK(it != other.end(), kGather, ": output ", where, " of replica ", i,
                    " lacks the key ", key, " that replica 0 has");
        column.push_back(it->value());
      }
      items.insert(entry.key(), gather_value(column, destination, dim, where + "[" + key + "]"));
    }
    return items;
  }
  TORCH_CHECK(false, kGather, ": cannot gather output ", where, " of type ", first.tagKind(),
              "; outputs must be tensors, None, or tuples, lists and dicts of them");
}

} // namespace

std::vector<c10::IValue> scatter(const c10::IValue& inputs, const std::vector<c10::Device>& devices,
                                 int64_t dim) {
  const auto normalized = normalize_devices(devices, kScatter);
  return scatter_value(inputs, normalized, dim, "<input>");
}

c10::IValue gather(const std::vector<c10::IValue>& outputs, c10::Device destination, int64_t dim) {
  TORCH_CHECK(!outputs.empty(), kGather, ": expected at least one output to gather, got none");
  return gather_value(outputs, normalize_device(destination, kGather), dim, "<output>");
}

} // namespace torchdp
