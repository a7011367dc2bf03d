#include "test_common.h"

#include <torchdp/structure.h>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>

#include <cstdint>
#include <string>
#include <vector>

using torchdp_test::cpu_devices;

namespace {

const torch::Device kCpu(torch::kCPU);

c10::IValue tuple_of(std::vector<c10::IValue> items) {
  return c10::ivalue::Tuple::create(std::move(items));
}

c10::IValue generic_list(std::vector<c10::IValue> items,
                         const c10::TypePtr& type = c10::AnyType::get()) {
  c10::impl::GenericList list(type);
  for (auto& item : items) {
    list.push_back(std::move(item));
  }
  return list;
}

/// Deep equality of two IValues; tensors compare by value.
bool same_value(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() || b.isTensor()) {
    return a.isTensor() && b.isTensor() && a.toTensor().sizes() == b.toTensor().sizes() &&
           torch::equal(a.toTensor(), b.toTensor());
  }
  if (a.isTuple() || b.isTuple()) {
    if (!a.isTuple() || !b.isTuple()) {
      return false;
    }
    const auto& ea = a.toTupleRef().elements();
    const auto& eb = b.toTupleRef().elements();
    if (ea.size() != eb.size()) {
      return false;
    }
    for (size_t i = 0; i < ea.size(); ++i) {
      if (!same_value(ea[i], eb[i])) {
        return false;
      }
    }
    return true;
  }
  if (a.isList() || b.isList()) {
    if (!a.isList() || !b.isList()) {
      return false;
    }
    const auto la = a.toListRef();
    const auto lb = b.toListRef();
    if (la.size() != lb.size()) {
      return false;
    }
    for (size_t i = 0; i < la.size(); ++i) {
      if (!same_value(la[i], lb[i])) {
        return false;
      }
    }
    return true;
  }
  if (a.isGenericDict() || b.isGenericDict()) {
    if (!a.isGenericDict() || !b.isGenericDict()) {
      return false;
    }
    const auto da = a.toGenericDict();
    const auto db = b.toGenericDict();
    if (da.size() != db.size()) {
      return false;
    }
    auto ia = da.begin();
    auto ib = db.begin();
    for (; ia != da.end(); ++ia, ++ib) {
      if (ia->key() != ib->key() || !same_value(ia->value(), ib->value())) {
        return false;
      }
    }
    return true;
  }
  return a == b;
}

} // namespace

// ---------------------------------------------------------------------------------------------
// scatter

TEST_CASE("torchdp::scatter of a tensor", "[cpu][structure]") {
  struct Case {
    int64_t rows;
    size_t devices;
    std::vector<int64_t> sizes;
  };
  const auto c = GENERATE(values<Case>({
      {8, 4, {2, 2, 2, 2}},
      {5, 4, {2, 2, 1}},
      {3, 4, {1, 1, 1}},
      {2, 1, {2}},
  }));
  const auto x = torch::randn({c.rows, 2});
  const auto chunks = torchdp::scatter(x, cpu_devices(c.devices));
  INFO("rows " << c.rows << ", devices " << c.devices);
  REQUIRE(chunks.size() == c.sizes.size());
  int64_t offset = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    REQUIRE(chunks[i].isTensor());
    CHECK(torch::equal(chunks[i].toTensor(), x.narrow(0, offset, c.sizes[i])));
    offset += c.sizes[i];
  }
}

TEST_CASE("torchdp::scatter along dim 1", "[cpu][structure]") {
  const auto x = torch::randn({2, 6});
  const auto dim = GENERATE(as<int64_t>{}, 1, -1);
  const auto chunks = torchdp::scatter(x, cpu_devices(3), dim);
  REQUIRE(chunks.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(torch::equal(chunks[i].toTensor(), x.narrow(1, 2 * static_cast<int64_t>(i), 2)));
  }
}

TEST_CASE("torchdp::scatter of a tuple replicates non-tensors", "[cpu][structure]") {
  const auto x = torch::randn({4, 3});
  const auto input =
      tuple_of({x, c10::IValue(int64_t{7}), c10::IValue(std::string("mode")), c10::IValue(), 2.5});
  const auto chunks = torchdp::scatter(input, cpu_devices(4));
  REQUIRE(chunks.size() == 4);
  for (size_t i = 0; i < chunks.size(); ++i) {
    INFO("chunk " << i);
    REQUIRE(chunks[i].isTuple());
    const auto& e = chunks[i].toTupleRef().elements();
    REQUIRE(e.size() == 5);
    CHECK(torch::equal(e[0].toTensor(), x.narrow(0, static_cast<int64_t>(i), 1)));
    REQUIRE(e[1].isInt());
    CHECK(e[1].toInt() == 7);
    REQUIRE(e[2].isString());
    CHECK(e[2].toStringRef() == "mode");
    CHECK(e[3].isNone());
    REQUIRE(e[4].isDouble());
    CHECK(e[4].toDouble() == 2.5);
  }
}

TEST_CASE("torchdp::scatter truncates to the fewest chunks", "[cpu][structure]") {
  SECTION("3 and 5 rows on 4 devices: both give 3 chunks") {
    // chunk(4) takes ceil(3/4) = 1 row per chunk -> [1, 1, 1]; ceil(5/4) = 2 -> [2, 2, 1].
    const auto a = torch::randn({3, 2});
    const auto b = torch::randn({5, 2});
    const auto chunks = torchdp::scatter(tuple_of({a, b}), cpu_devices(4));
    REQUIRE(chunks.size() == 3);
    const std::vector<int64_t> b_sizes{2, 2, 1};
    int64_t b_offset = 0;
    for (size_t i = 0; i < 3; ++i) {
      const auto& e = chunks[i].toTupleRef().elements();
      CHECK(torch::equal(e[0].toTensor(), a.narrow(0, static_cast<int64_t>(i), 1)));
      CHECK(torch::equal(e[1].toTensor(), b.narrow(0, b_offset, b_sizes[i])));
      b_offset += b_sizes[i];
    }
  }
  SECTION("2 and 8 rows on 4 devices: 2 chunks") {
    const auto a = torch::randn({2, 2});
    const auto b = torch::randn({8, 2});
    const auto chunks = torchdp::scatter(tuple_of({a, b, int64_t{1}}), cpu_devices(4));
    REQUIRE(chunks.size() == 2);
    for (size_t i = 0; i < 2; ++i) {
      const auto& e = chunks[i].toTupleRef().elements();
      CHECK(e[0].toTensor().size(0) == 1);
      CHECK(e[1].toTensor().size(0) == 2);
      CHECK(torch::equal(e[1].toTensor(), b.narrow(0, 2 * static_cast<int64_t>(i), 2)));
      CHECK(e[2].toInt() == 1);
    }
  }
  SECTION("the shortest leaf is nested") {
    const auto a = torch::randn({8, 2});
    const auto inner = generic_list({torch::randn({1, 2})});
    const auto chunks = torchdp::scatter(tuple_of({a, tuple_of({inner})}), cpu_devices(4));
    REQUIRE(chunks.size() == 1);
    CHECK(torch::equal(chunks[0].toTupleRef().elements()[0].toTensor(), a.narrow(0, 0, 2)));
  }
}

// A named tuple (from TorchScript) keeps its type through scatter and gather, as namedtuples are
// rebuilt with type(obj) by torch.nn.parallel.scatter and gather.
TEST_CASE("torchdp::scatter and gather keep a named tuple's type", "[cpu][structure]") {
  const c10::TypePtr type = c10::TupleType::createNamed(
      c10::QualifiedName("__torch__.Batch"), std::vector<std::string>{"x", "y"},
      std::vector<c10::TypePtr>{c10::TensorType::get(), c10::TensorType::get()});
  const auto x = torch::randn({4, 2});
  const auto y = torch::randn({4});
  const c10::IValue input(c10::ivalue::Tuple::createNamed(std::vector<c10::IValue>{x, y}, type));
  REQUIRE(input.toTupleRef().type()->name().has_value());

  const auto chunks = torchdp::scatter(input, cpu_devices(2));
  REQUIRE(chunks.size() == 2);
  for (const auto& chunk : chunks) {
    const auto chunk_type = chunk.toTupleRef().type();
    REQUIRE(chunk_type->name().has_value());
    CHECK(chunk_type->name()->qualifiedName() == "__torch__.Batch");
    CHECK(*chunk_type == *type);
  }
  const auto out = torchdp::gather(chunks, kCpu);
  const auto out_type = out.toTupleRef().type();
  REQUIRE(out_type->name().has_value());
  CHECK(out_type->name()->qualifiedName() == "__torch__.Batch");
  CHECK(same_value(out, input));
}

TEST_CASE("torchdp::scatter of a generic list", "[cpu][structure]") {
  const auto x = torch::randn({6, 2});
  const auto y = torch::randn({6});
  const auto input = generic_list({x, int64_t{3}, y});
  const auto chunks = torchdp::scatter(input, cpu_devices(3));
  REQUIRE(chunks.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    INFO("chunk " << i);
    REQUIRE(chunks[i].isList());
    const auto list = chunks[i].toList();
    CHECK(*list.elementType() == *c10::AnyType::get());
    REQUIRE(list.size() == 3);
    const auto offset = 2 * static_cast<int64_t>(i);
    CHECK(torch::equal(list.get(0).toTensor(), x.narrow(0, offset, 2)));
    CHECK(list.get(1).toInt() == 3);
    CHECK(torch::equal(list.get(2).toTensor(), y.narrow(0, offset, 2)));
  }
}

TEST_CASE("torchdp::scatter keeps the element type of a tensor list", "[cpu][structure]") {
  c10::List<at::Tensor> tensors;
  tensors.push_back(torch::randn({4, 2}));
  tensors.push_back(torch::randn({4}));
  const auto chunks = torchdp::scatter(c10::IValue(tensors), cpu_devices(2));
  REQUIRE(chunks.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    REQUIRE(chunks[i].isTensorList());
    const auto list = chunks[i].toTensorList();
    REQUIRE(list.size() == 2);
    CHECK(torch::equal(list.get(0), tensors.get(0).narrow(0, 2 * static_cast<int64_t>(i), 2)));
    CHECK(torch::equal(list.get(1), tensors.get(1).narrow(0, 2 * static_cast<int64_t>(i), 2)));
  }
}

TEST_CASE("torchdp::scatter of a list of ints replicates it", "[cpu][structure]") {
  const c10::IValue input(std::vector<int64_t>{1, 2, 3});
  const auto chunks = torchdp::scatter(input, cpu_devices(3));
  REQUIRE(chunks.size() == 3);
  for (const auto& chunk : chunks) {
    REQUIRE(chunk.isIntList());
    CHECK(chunk.toIntVector() == std::vector<int64_t>{1, 2, 3});
  }
}

TEST_CASE("torchdp::scatter of a dict", "[cpu][structure]") {
  c10::Dict<std::string, at::Tensor> dict;
  const auto a = torch::randn({4, 3});
  const auto b = torch::randn({4});
  dict.insert("b", b);
  dict.insert("a", a);
  const auto chunks = torchdp::scatter(c10::IValue(dict), cpu_devices(2));
  REQUIRE(chunks.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    INFO("chunk " << i);
    REQUIRE(chunks[i].isGenericDict());
    const auto d = chunks[i].toGenericDict();
    CHECK(*d.keyType() == *c10::StringType::get());
    CHECK(*d.valueType() == *c10::TensorType::get());
    REQUIRE(d.size() == 2);
    // Insertion order is kept.
    CHECK(d.begin()->key().toStringRef() == "b");
    const auto offset = 2 * static_cast<int64_t>(i);
    CHECK(torch::equal(d.at("a").toTensor(), a.narrow(0, offset, 2)));
    CHECK(torch::equal(d.at("b").toTensor(), b.narrow(0, offset, 2)));
    // The typed view works too.
    const auto typed = c10::impl::toTypedDict<std::string, at::Tensor>(d);
    CHECK(typed.at("a").size(0) == 2);
  }
}

TEST_CASE("torchdp::scatter replicates values without tensors", "[cpu][structure]") {
  const auto n = GENERATE(as<size_t>{}, 1, 3);
  const std::vector<c10::IValue> values{
      c10::IValue(int64_t{5}),
      c10::IValue(std::string("text")),
      c10::IValue(),
      c10::IValue(true),
      tuple_of({}),
      generic_list({}),
      c10::IValue(c10::impl::GenericDict(c10::StringType::get(), c10::TensorType::get())),
      tuple_of({int64_t{1}, std::string("x")}),
  };
  for (size_t v = 0; v < values.size(); ++v) {
    INFO("value " << v << ": " << values[v].tagKind());
    const auto chunks = torchdp::scatter(values[v], cpu_devices(n));
    REQUIRE(chunks.size() == n);
    for (const auto& chunk : chunks) {
      CHECK(chunk.tagKind() == values[v].tagKind());
      CHECK(same_value(chunk, values[v]));
    }
  }
}

TEST_CASE("torchdp::scatter is differentiable", "[cpu][structure]") {
  const auto x = torch::randn({6, 2}).requires_grad_(true);
  const auto chunks = torchdp::scatter(tuple_of({x}), cpu_devices(3));
  REQUIRE(chunks.size() == 3);
  auto loss = torch::zeros({});
  for (size_t i = 0; i < 3; ++i) {
    const auto t = chunks[i].toTupleRef().elements()[0].toTensor();
    CHECK(t.requires_grad());
    loss = loss + t.sum() * static_cast<double>(i + 1);
  }
  loss.backward();
  const auto expected = torch::tensor({1.F, 1.F, 2.F, 2.F, 3.F, 3.F}).unsqueeze(1).expand({6, 2});
  CHECK(torch::equal(x.grad(), expected));
}

TEST_CASE("torchdp::scatter errors name the API", "[cpu][structure]") {
  TORCHDP_CHECK_THROWS_WITH(torchdp::scatter(torch::randn({2}), {}), "torchdp::scatter",
                            "empty device list");
  TORCHDP_CHECK_THROWS_WITH(torchdp::scatter(torch::randn({2}), {kCpu, torch::Device("xpu")}),
                            "torchdp::scatter", "xpu", "not supported");
}

// ---------------------------------------------------------------------------------------------
// gather

TEST_CASE("torchdp::gather of tensors, None and tuples", "[cpu][structure]") {
  const auto a0 = torch::randn({2, 3});
  const auto a1 = torch::randn({1, 3});
  SECTION("tensors") {
    const auto out = torchdp::gather({a0, a1}, kCpu);
    REQUIRE(out.isTensor());
    CHECK(torch::equal(out.toTensor(), torch::cat({a0, a1}, 0)));
  }
  SECTION("tensors along dim 1") {
    const auto b0 = torch::randn({2, 1});
    const auto b1 = torch::randn({2, 2});
    const auto out = torchdp::gather({b0, b1}, kCpu, -1);
    CHECK(torch::equal(out.toTensor(), torch::cat({b0, b1}, 1)));
  }
  SECTION("None") {
    CHECK(torchdp::gather({c10::IValue(), c10::IValue()}, kCpu).isNone());
  }
  SECTION("tuples") {
    const auto out =
        torchdp::gather({tuple_of({a0, c10::IValue()}), tuple_of({a1, c10::IValue()})}, kCpu);
    REQUIRE(out.isTuple());
    const auto& e = out.toTupleRef().elements();
    REQUIRE(e.size() == 2);
    CHECK(torch::equal(e[0].toTensor(), torch::cat({a0, a1}, 0)));
    CHECK(e[1].isNone());
  }
  SECTION("0-dim tensors become a vector") {
    const auto out = torchdp::gather({torch::tensor(1.F), torch::tensor(2.F)}, kCpu);
    CHECK(torch::equal(out.toTensor(), torch::tensor({1.F, 2.F})));
  }
  SECTION("to meta") {
    const auto out = torchdp::gather({a0, a1}, torch::Device(torch::kMeta));
    CHECK(out.toTensor().device().is_meta());
    CHECK(out.toTensor().sizes() == torch::IntArrayRef({3, 3}));
  }
}

TEST_CASE("torchdp::gather(torchdp::scatter(x)) round-trips nested structures",
          "[cpu][structure]") {
  const auto n = GENERATE(as<size_t>{}, 1, 2, 4);
  c10::Dict<std::string, at::Tensor> dict;
  dict.insert("w", torch::randn({8, 2, 2}));
  dict.insert("v", torch::randn({8}));
  const auto input = tuple_of({
      torch::randn({8, 3}),
      generic_list({torch::randn({8, 1}), tuple_of({torch::randn({8, 4}), c10::IValue()})}),
      c10::IValue(dict),
  });
  const auto chunks = torchdp::scatter(input, cpu_devices(n));
  REQUIRE(chunks.size() == n);
  const auto out = torchdp::gather(chunks, kCpu);
  CHECK(same_value(out, input));
  // Containers are rebuilt with their key and element types.
  REQUIRE(out.toTupleRef().elements()[2].isGenericDict());
  const auto d = out.toTupleRef().elements()[2].toGenericDict();
  CHECK(*d.keyType() == *c10::StringType::get());
  CHECK(*d.valueType() == *c10::TensorType::get());
}

TEST_CASE("torchdp::gather round trip carries gradients", "[cpu][structure]") {
  const auto x = torch::randn({5, 2}).requires_grad_(true);
  const auto y = torch::randn({5}).requires_grad_(true);
  const auto chunks = torchdp::scatter(generic_list({x, y}), cpu_devices(4));
  REQUIRE(chunks.size() == 3);
  const auto out = torchdp::gather(chunks, kCpu).toList();
  (out.get(0).toTensor().sum() + 2 * out.get(1).toTensor().sum()).backward();
  CHECK(torch::equal(x.grad(), torch::ones({5, 2})));
  CHECK(torch::equal(y.grad(), torch::full({5}, 2.F)));
}

TEST_CASE("torchdp::scatter errors name the input's place", "[cpu][structure]") {
  c10::Dict<std::string, at::Tensor> batch;
  batch.insert("scale", torch::tensor(2.F)); // 0-dim: cannot be split
  const auto input = c10::IValue(std::make_tuple(torch::ones({4, 2}), batch));
  TORCHDP_CHECK_THROWS_WITH(torchdp::scatter(input, cpu_devices(2)), "torchdp::scatter",
                            "input <input>[1]['scale']: torchdp::comm::scatter", "0-dim");
}

TEST_CASE("torchdp::gather errors", "[cpu][structure]") {
  const char* api = "torchdp::gather";
  SECTION("dicts with different numbers of keys") {
    c10::Dict<std::string, at::Tensor> one, two;
    one.insert("a", torch::ones({1}));
    two.insert("a", torch::ones({1}));
    two.insert("b", torch::ones({1}));
    TORCHDP_CHECK_THROWS_WITH(torchdp::gather({c10::IValue(one), c10::IValue(two)}, kCpu), api,
                              "same number of keys", "replica 0 has 1", "replica 1");
  }
  SECTION("dicts with different keys") {
    c10::Dict<std::string, at::Tensor> one, two;
    one.insert("a", torch::ones({1}));
    two.insert("b", torch::ones({1}));
    TORCHDP_CHECK_THROWS_WITH(torchdp::gather({c10::IValue(one), c10::IValue(two)}, kCpu), api,
                              "replica 1", "lacks the key 'a'");
  }
  SECTION("tensors that cannot be concatenated, named by their place in the output") {
    c10::Dict<std::string, at::Tensor> one, two;
    one.insert("logits", torch::ones({2, 3}));
    two.insert("logits", torch::ones({2, 4}));
    const auto out = [](const c10::Dict<std::string, at::Tensor>& d) {
      return c10::IValue(std::make_tuple(torch::ones({1}), d));
    };
    TORCHDP_CHECK_THROWS_WITH(torchdp::gather({out(one), out(two)}, kCpu), api,
                              "output <output>[1]['logits']: torchdp::comm::gather");
  }
  SECTION("a non-gatherable type") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::gather({c10::IValue(int64_t{1}), c10::IValue(int64_t{2})}, kCpu), api,
        "of type Int");
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::gather({c10::IValue(std::string("a")), c10::IValue(std::string("b"))}, kCpu), api,
        "of type String");
  }
  SECTION("a nested non-gatherable value names its position") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::gather({tuple_of({torch::ones({1}), 1.5}), tuple_of({torch::ones({1}), 2.5})},
                        kCpu),
        api, "<output>[1]", "of type Double");
  }
  SECTION("a tensor in one replica, something else in another") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::gather({c10::IValue(torch::ones({1})), c10::IValue(int64_t{3})}, kCpu), api,
        "replica 1 returned Int");
  }
  SECTION("tuples of different sizes") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::gather(
            {tuple_of({torch::ones({1}), torch::ones({1})}), tuple_of({torch::ones({1})})}, kCpu),
        api, "tuple of 2 elements", "replica 1");
  }
  SECTION("lists of different sizes") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::gather({generic_list({torch::ones({1})}), generic_list({})}, kCpu), api,
        "list of 1 elements", "replica 1");
  }
  SECTION("no outputs") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::gather({}, kCpu), api, "at least one output");
  }
}
