// The nested scatter and gather over c10::IValue (Note [Nested scatter and gather]).
#include <torchdp/autograd.h>
#include <torchdp/devices.h>
#include <torchdp/errors.h>
#include <torchdp/structure.h>

#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <sstream>
#include <variant>

namespace torchdp {
namespace detail {
namespace {

// One step of a path from the root: a tuple or list index, or a dict key.
using Segment = std::variant<size_t, c10::IValue>;

std::string format_key(const c10::IValue& key) {
  std::ostringstream o;
  if (key.isString()) {
    o << "'" << key.toStringRef() << "'";
  } else {
    o << key;
  }
  return o.str();
}

std::string format_path(const ValueNames& names, const std::vector<Segment>& path) {
  std::string out = names.root;
  size_t start = 0;
  if (names.arguments && !path.empty() && std::holds_alternative<size_t>(path[0])) {
    out += " " + std::to_string(std::get<size_t>(path[0]));
    start = 1;
  }
  for (size_t i = start; i < path.size(); ++i) {
    if (std::holds_alternative<size_t>(path[i])) {
      out += "[" + std::to_string(std::get<size_t>(path[i])) + "]";
    } else {
      out += "[" + format_key(std::get<c10::IValue>(path[i])) + "]";
    }
  }
  return out;
}

std::string describe(const c10::IValue& v) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    return t.defined() ? c10::str("a tensor of shape ", t.sizes(), " on ", t.device())
                       : std::string("an undefined tensor");
  }
  std::ostringstream o;
  o << v.tagKind();
  if (v.isTuple()) {
    o << " of " << v.toTupleRef().size();
  } else if (v.isList()) {
    o << " of " << v.toListRef().size();
  } else if (v.isGenericDict()) {
    o << " of " << v.toGenericDict().size();
  } else if (v.isInt() || v.isDouble() || v.isBool() || v.isString() || v.isDevice()) {
    o << " " << v;
  }
  return o.str();
}

c10::IValue make_tuple(const c10::IValue& like, std::vector<c10::IValue> elements) {
  const auto type = like.toTupleRef().type();
  if (type->name()) { // a named tuple keeps its type (and so its field names)
    return c10::ivalue::Tuple::createNamed(c10::ivalue::TupleElements(std::move(elements)), type);
  }
  return c10::ivalue::Tuple::create(std::move(elements));
}

// The replicas' outputs zipped along replica 0's structure (checked alike): one column of
// tensors per tensor of replica 0, in for_each_tensor's order.
struct Zipper {
  const char* api;
  const ValueNames& names;
  std::vector<Segment> path;
  std::vector<std::vector<at::Tensor>> columns;

  std::string name() const {
    return format_path(names, path);
  }

  [[noreturn]] void mismatch(const std::vector<c10::IValue>& outs, size_t i) const {
    TORCH_CHECK_VALUE(false, api, ": the replicas' outputs differ at ", name(), ": replica 0 gave ",
                      describe(outs[0]), " but replica ", i, " gave ", describe(outs[i]),
                      "; every replica must return values of one structure (tensors are joined "
                      "along dim, other values must be equal)");
  }

  void zip(const std::vector<c10::IValue>& outs) {
    const auto& first = outs[0];
    if (first.isTensor()) {
      std::vector<at::Tensor> tensors;
      tensors.reserve(outs.size());
      for (const auto i : c10::irange(outs.size())) {
        TORCH_CHECK_VALUE(outs[i].isTensor(), api, ": the replicas' outputs differ at ", name(),
                          ": replica 0 gave ", describe(first), " but replica ", i, " gave ",
                          describe(outs[i]), "; every replica must return values of one structure");
        TORCH_CHECK(outs[i].toTensor().defined(), api, ": replica ", i,
                    " returned an undefined tensor at ", name(), ", which cannot be gathered");
        tensors.push_back(outs[i].toTensor());
      }
      columns.push_back(std::move(tensors));
    } else if (first.isTuple() || first.isList()) {
      const bool tuple = first.isTuple();
      const size_t size = tuple ? first.toTupleRef().size() : first.toListRef().size();
      for (const auto i : c10::irange(outs.size())) {
        const bool same_kind = tuple ? outs[i].isTuple() : outs[i].isList();
        if (!same_kind ||
            (tuple ? outs[i].toTupleRef().size() : outs[i].toListRef().size()) != size) {
          mismatch(outs, i);
        }
      }
      std::vector<c10::IValue> column(outs.size());
      for (const auto k : c10::irange(size)) {
        for (const auto i : c10::irange(outs.size())) {
          column[i] = tuple ? outs[i].toTupleRef().elements()[k] : outs[i].toListRef()[k];
        }
        path.emplace_back(k);
        zip(column);
        path.pop_back();
      }
    } else if (first.isGenericDict()) {
      const auto dict = first.toGenericDict();
      for (const auto i : c10::irange(outs.size())) {
        if (!outs[i].isGenericDict() || outs[i].toGenericDict().size() != dict.size()) {
          mismatch(outs, i);
        }
      }
      std::vector<c10::IValue> column(outs.size());
      for (const auto& entry : dict) {
        for (const auto i : c10::irange(outs.size())) {
          const auto other = outs[i].toGenericDict();
          const auto it = other.find(entry.key());
          TORCH_CHECK_VALUE(it != other.end(), api, ": the replicas' outputs differ at ", name(),
                            ": replica 0's dict has the key ", format_key(entry.key()),
                            " but replica ", i,
                            "'s has not; every replica must return the same keys");
          column[i] = it->value();
        }
        path.emplace_back(entry.key());
        zip(column);
        path.pop_back();
      }
    } else if (!first.isNone()) { // None is kept, as Python's gather, whatever the others gave
      for (const auto i : c10::irange(outs.size())) {
        const bool same = outs[i].isSameIdentity(first) ||
                          (outs[i].tagKind() == first.tagKind() &&
                           (first.isInt() || first.isDouble() || first.isBool() ||
                            first.isString() || first.isDevice()) &&
                           outs[i] == first);
        if (!same) {
          mismatch(outs, i);
        }
      }
    }
  }
};

} // namespace

void check_splittable(const at::Tensor& t, const std::string& name, int64_t dim, const char* api,
                      const char* dim_note) {
  TORCH_CHECK(t.defined(), api, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.dim() > 0, api, ": ", name, " is a 0-dim tensor, which cannot be split along dim ",
              dim, "; give it a batch dimension");
  TORCH_CHECK_INDEX(dim >= -t.dim() && dim < t.dim(), api, ": dim ", dim, dim_note,
                    " is out of range for ", name, " of shape ", t.sizes(), "; it must be in [",
                    -t.dim(), ", ", t.dim() - 1, "], the dimension the batch is split along");
}

std::vector<std::vector<at::Tensor>> scatter_tensors(const std::vector<at::Tensor>& tensors,
                                                     const std::vector<c10::Device>& devices,
                                                     int64_t dim, const char* api,
                                                     const std::function<std::string(size_t)>& name,
                                                     const char* dim_note) {
  std::vector<std::vector<at::Tensor>> chunks(tensors.size());
  for (const auto k : c10::irange(tensors.size())) {
    const auto& t = tensors[k];
    check_splittable(t, name(k), dim, api, dim_note);
    try {
      chunks[k] = autograd::scatter(t, devices, std::nullopt, dim);
    } catch (...) {
      rethrow_with_prefix(c10::str(api, ": cannot split ", name(k), ": "));
    }
  }
  return chunks;
}

std::vector<c10::IValue> scatter_value(const c10::IValue& input,
                                       const std::vector<c10::Device>& devices_in, int64_t dim,
                                       const char* api, const ValueNames& names) {
  const auto devices = normalize_devices(devices_in, api);
  const auto tensors = tensors_of(input);
  const auto chunks = scatter_tensors(tensors, devices, dim, api, [&](size_t k) {
    return tensor_name(input, names, k);
  });
  size_t count = devices.size();
  for (const auto& c : chunks) {
    count = std::min(count, c.size());
  }
  std::vector<c10::IValue> out;
  out.reserve(count);
  for (const auto i : c10::irange(count)) {
    out.push_back(map_tensors(
        input,
        [&](size_t k, const at::Tensor&) {
          return chunks[k][i];
        },
        /*keep_unchanged=*/false));
  }
  return out;
}

c10::IValue gather_value(const std::vector<c10::IValue>& outputs, c10::Device destination,
                         int64_t dim, const char* api, const ValueNames& names,
                         const std::optional<at::Scalar>& pad_value) {
  TORCH_CHECK(!outputs.empty(), api, ": got no outputs to gather; pass one per replica");
  const auto to = normalize_device(destination, api);
  Zipper z{api, names, {}, {}};
  z.zip(outputs);
  std::vector<at::Tensor> joined;
  joined.reserve(z.columns.size());
  for (const auto k : c10::irange(z.columns.size())) {
    try {
      joined.push_back(autograd::gather(z.columns[k], to, dim, pad_value));
    } catch (...) {
      rethrow_with_prefix(
          c10::str(api, ": cannot gather ", tensor_name(outputs[0], names, k), ": "));
    }
  }
  return map_tensors(
      outputs[0],
      [&joined](size_t k, const at::Tensor&) {
        return joined[k];
      },
      /*keep_unchanged=*/false);
}

c10::IValue to_device(const c10::IValue& value, c10::Device device, const char* api,
                      const ValueNames& names) {
  return map_tensors(
      value,
      [&](size_t k, const at::Tensor& t) {
        TORCH_CHECK(t.defined(), api, ": ", tensor_name(value, names, k),
                    " is an undefined tensor");
        return detail::canonical(t.device()) == device ? t : t.to(device);
      },
      /*keep_unchanged=*/true);
}

c10::IValue map_tensors(const c10::IValue& value,
                        const std::function<at::Tensor(size_t, const at::Tensor&)>& fn,
                        bool keep_unchanged) {
  size_t next = 0;
  std::function<c10::IValue(const c10::IValue&)> rebuild =
      [&](const c10::IValue& v) -> c10::IValue {
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      auto mapped = fn(next++, t);
      return keep_unchanged && mapped.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()
                 ? v
                 : c10::IValue(std::move(mapped));
    }
    bool changed = !keep_unchanged;
    if (v.isTuple() || v.isList()) {
      const bool tuple = v.isTuple();
      const auto elements = tuple
                                ? c10::ArrayRef<c10::IValue>(v.toTupleRef().elements().asArrayRef())
                                : v.toListRef();
      std::vector<c10::IValue> members;
      members.reserve(elements.size());
      for (const auto& e : elements) {
        members.push_back(rebuild(e));
        changed = changed || !members.back().isSameIdentity(e);
      }
      if (!changed) {
        return v;
      }
      if (tuple) {
        return make_tuple(v, std::move(members));
      }
      c10::impl::GenericList list(v.toList().elementType());
      list.reserve(members.size());
      for (auto& m : members) {
        list.push_back(std::move(m));
      }
      return list;
    }
    if (v.isGenericDict()) {
      const auto dict = v.toGenericDict();
      c10::impl::GenericDict copy(dict.keyType(), dict.valueType());
      copy.reserve(dict.size());
      for (const auto& entry : dict) {
        auto member = rebuild(entry.value());
        changed = changed || !member.isSameIdentity(entry.value());
        copy.insert(entry.key(), std::move(member));
      }
      return changed ? c10::IValue(copy) : v;
    }
    return v; // passed as it is (to every replica, when scattering)
  };
  return rebuild(value);
}

void for_each_tensor(
    const c10::IValue& value, const ValueNames& names,
    const std::function<void(const at::Tensor&, const std::function<std::string()>&)>& fn) {
  std::vector<Segment> path;
  const std::function<std::string()> name = [&]() {
    return format_path(names, path);
  };
  std::function<void(const c10::IValue&)> visit = [&](const c10::IValue& v) {
    if (v.isTensor()) {
      fn(v.toTensor(), name);
    } else if (v.isTuple() || v.isList()) {
      const auto elements = v.isTuple()
                                ? c10::ArrayRef<c10::IValue>(v.toTupleRef().elements().asArrayRef())
                                : v.toListRef();
      for (const auto k : c10::irange(elements.size())) {
        path.emplace_back(k);
        visit(elements[k]);
        path.pop_back();
      }
    } else if (v.isGenericDict()) {
      for (const auto& entry : v.toGenericDict()) {
        path.emplace_back(entry.key());
        visit(entry.value());
        path.pop_back();
      }
    }
  };
  visit(value);
}

std::vector<at::Tensor> tensors_of(const c10::IValue& value) {
  std::vector<at::Tensor> out;
  for_each_tensor(value, ValueNames{}, [&out](const at::Tensor& t, const auto&) {
    out.push_back(t);
  });
  return out;
}

std::string tensor_name(const c10::IValue& value, const ValueNames& names, size_t k) {
  std::string found;
  size_t seen = 0;
  for_each_tensor(value, names, [&](const at::Tensor&, const std::function<std::string()>& name) {
    if (seen++ == k) {
      found = name();
    }
  });
  return found;
}

} // namespace detail

std::vector<c10::IValue> scatter(const c10::IValue& input, const std::vector<c10::Device>& devices,
                                 int64_t dim) {
  return detail::scatter_value(input, devices, dim, "torchdp::scatter", detail::ValueNames{});
}

c10::IValue gather(const std::vector<c10::IValue>& outputs, c10::Device destination, int64_t dim,
                   const std::optional<at::Scalar>& pad_value) {
  return detail::gather_value(outputs, destination, dim, "torchdp::gather",
                              detail::ValueNames{"the output", false}, pad_value);
}

} // namespace torchdp
