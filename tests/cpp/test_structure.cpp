// The nested scatter and gather over c10::IValue and their typed forms (structure.h).
#include "test_common.h"

using namespace torchdp_test;

namespace {

c10::IValue tuple_of(std::vector<c10::IValue> values) {
  return c10::ivalue::Tuple::create(std::move(values));
}

c10::IValue dict_of(std::vector<std::pair<std::string, c10::IValue>> entries) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (auto& [k, v] : entries) {
    dict.insert(k, std::move(v));
  }
  return dict;
}

} // namespace

TEST_CASE("scatter splits a tensor as torch.chunk does", "[cpu][structure]") {
  const auto x = torch::arange(10).reshape({5, 2});
  for (size_t n : {1, 2, 3, 4, 5, 7}) {
    INFO(n << " devices");
    const auto parts = torchdp::scatter(c10::IValue(x), cpu_devices(n));
    const auto chunks = x.chunk(static_cast<int64_t>(n));
    REQUIRE(parts.size() == chunks.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      CHECK(torch::equal(parts[i].toTensor(), chunks[i]));
    }
  }
  SECTION("along another dimension") {
    const auto parts = torchdp::scatter(c10::IValue(x), cpu_devices(2), 1);
    REQUIRE(parts.size() == 2);
    CHECK(torch::equal(parts[1].toTensor(), x.select(1, 1).unsqueeze(1)));
  }
}

TEST_CASE("scatter keeps the structure and passes other values to every replica",
          "[cpu][structure]") {
  const auto x = torch::randn({6, 3});
  const auto y = torch::randn({6});
  c10::List<at::Tensor> list({x, y});
  const auto input =
      tuple_of({x, c10::IValue(list), dict_of({{"b", y}, {"a", c10::IValue(int64_t{7})}}),
                c10::IValue(2.5), c10::IValue(std::string("mode")), c10::IValue()});
  const auto parts = torchdp::scatter(input, cpu_devices(3));
  REQUIRE(parts.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    const auto& e = parts[i].toTupleRef().elements();
    REQUIRE(e.size() == 6);
    const auto rows = torch::arange(2 * static_cast<int64_t>(i), 2 * static_cast<int64_t>(i) + 2);
    CHECK(torch::equal(e[0].toTensor(), x.index_select(0, rows)));
    REQUIRE(e[1].isTensorList()); // the list keeps its element type
    CHECK(torch::equal(e[1].toTensorVector()[1], y.index_select(0, rows)));
    const auto dict = e[2].toGenericDict();
    CHECK(dict.begin()->key().toStringRef() == "b"); // insertion order kept
    CHECK(torch::equal(dict.at("b").toTensor(), y.index_select(0, rows)));
    CHECK(dict.at("a").toInt() == 7);
    CHECK(e[3].toDouble() == 2.5);
    CHECK(e[4].toStringRef() == "mode");
    CHECK(e[5].isNone());
  }
}

TEST_CASE("scatter gives as many replicas as the fewest chunks", "[cpu][structure]") {
  // As torch.nn.parallel.scatter's zip: 5 rows give 3 chunks over 4 devices, 2 rows give 2.
  const auto input = tuple_of({torch::randn({5, 2}), torch::randn({2, 2})});
  CHECK(torchdp::scatter(input, cpu_devices(4)).size() == 2);
  SECTION("a value without tensors goes to every device") {
    const auto parts =
        torchdp::scatter(tuple_of({c10::IValue(int64_t{1}), c10::IValue("s")}), cpu_devices(3));
    REQUIRE(parts.size() == 3);
    CHECK(parts[2].toTupleRef().elements()[0].toInt() == 1);
  }
  SECTION("an empty container goes to every replica (Python would give none)") {
    const auto parts =
        torchdp::scatter(tuple_of({torch::randn({4}), tuple_of({})}), cpu_devices(2));
    REQUIRE(parts.size() == 2);
    CHECK(parts[1].toTupleRef().elements()[1].toTupleRef().size() == 0);
  }
}

TEST_CASE("scatter keeps named tuples", "[cpu][structure]") {
  auto type = c10::TupleType::createNamed(
      c10::QualifiedName("torchdp_test.Pair"), std::vector<std::string>{"first", "second"},
      std::vector<c10::TypePtr>{c10::TensorType::get(), c10::IntType::get()});
  auto named = c10::ivalue::Tuple::createNamed({torch::randn({4, 2}), int64_t{3}}, type);
  const auto parts = torchdp::scatter(c10::IValue(named), cpu_devices(2));
  REQUIRE(parts.size() == 2);
  const auto t = parts[1].toTupleRef().type();
  REQUIRE(t->name().has_value());
  CHECK(t->name()->qualifiedName() == "torchdp_test.Pair");
  const auto back = torchdp::gather(parts, torch::kCPU);
  CHECK(back.toTupleRef().type()->name().has_value());
  CHECK(torch::equal(back.toTupleRef().elements()[0].toTensor(), named->elements()[0].toTensor()));
}

TEST_CASE("gather joins what scatter split, differentiably", "[cpu][structure]") {
  const auto devices = GENERATE(cpu_devices(2), cpu_devices(3));
  const auto x = torch::randn({6, 3}, torch::requires_grad());
  const auto y = torch::randn({6, 2}, torch::requires_grad());
  const auto input = tuple_of({x, dict_of({{"y", y}, {"k", c10::IValue(int64_t{4})}}),
                               c10::IValue(c10::List<at::Tensor>({x * 2}))});
  const auto parts = torchdp::scatter(input, devices);
  const auto joined = torchdp::gather(parts, torch::kCPU);
  const auto& e = joined.toTupleRef().elements();
  CHECK(torch::equal(e[0].toTensor(), x));
  CHECK(torch::equal(e[1].toGenericDict().at("y").toTensor(), y));
  CHECK(e[1].toGenericDict().at("k").toInt() == 4);
  CHECK(e[2].isTensorList());
  CHECK(torch::allclose(e[2].toTensorVector()[0], x * 2));
  (e[0].toTensor().sum() * 2 + e[1].toGenericDict().at("y").toTensor().pow(2).sum() +
   e[2].toTensorVector()[0].sum())
      .backward();
  CHECK(torch::allclose(x.grad(), torch::full_like(x, 4.0)));
  CHECK(torch::allclose(y.grad(), 2 * y));
}

TEST_CASE("gather keeps None and equal values, refuses mismatches", "[cpu][structure]") {
  const auto a = torch::randn({2, 2});
  const auto b = torch::randn({3, 2});
  SECTION("None and equal numbers") {
    const auto out = torchdp::gather({tuple_of({a, c10::IValue(), c10::IValue(int64_t{5})}),
                                      tuple_of({b, c10::IValue(), c10::IValue(int64_t{5})})},
                                     torch::kCPU);
    const auto& e = out.toTupleRef().elements();
    CHECK(e[0].toTensor().size(0) == 5);
    CHECK(e[1].isNone());
    CHECK(e[2].toInt() == 5);
  }
  SECTION("different numbers") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::gather({tuple_of({a, c10::IValue(int64_t{1})}),
                                               tuple_of({b, c10::IValue(int64_t{2})})},
                                              torch::kCPU),
                              "torchdp::gather", "the output[1]", "replica 1", "Int 2");
  }
  SECTION("different lengths") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::gather({tuple_of({a, a}), tuple_of({b})}, torch::kCPU),
                              "differ at the output", "Tuple of 2", "Tuple of 1");
  }
  SECTION("a missing key") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::gather({dict_of({{"x", a}}), dict_of({{"z", b}})}, torch::kCPU), "key 'x'",
        "replica 1");
  }
  SECTION("a tensor against another type") {
    try {
      torchdp::gather({tuple_of({a}), tuple_of({c10::IValue(int64_t{1})})}, torch::kCPU);
      FAIL("no exception");
    } catch (const c10::ValueError& e) {
      CHECK(std::string(e.what_without_backtrace()).find("the output[0]") != std::string::npos);
    }
  }
  SECTION("tensors that do not fit") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::gather({c10::IValue(a), c10::IValue(torch::randn({2, 5}))}, torch::kCPU),
        "torchdp::gather: cannot gather the output");
  }
}

TEST_CASE("scatter names the tensor it cannot split", "[cpu][structure]") {
  const auto input = tuple_of({torch::randn({4, 2}), dict_of({{"s", torch::tensor(1.0)}})});
  TORCHDP_CHECK_THROWS_WITH(torchdp::scatter(input, cpu_devices(2)), "torchdp::scatter",
                            "the input[1]['s'] is a 0-dim tensor");
  TORCHDP_CHECK_THROWS_WITH(torchdp::scatter(tuple_of({at::Tensor()}), cpu_devices(2)),
                            "the input[0] is an undefined tensor");
  TORCHDP_CHECK_THROWS_WITH(torchdp::scatter(c10::IValue(torch::randn({4})), cpu_devices(2), 1),
                            "dim 1 is out of range for the input");
}

TEST_CASE("typed scatter and gather", "[cpu][structure]") {
  const auto x = torch::randn({4, 3});
  const auto y = torch::randn({4});
  SECTION("a tuple with a number") {
    const auto parts = torchdp::scatter(std::make_tuple(x, y, int64_t{3}), cpu_devices(2));
    static_assert(std::is_same_v<decltype(parts),
                                 const std::vector<std::tuple<at::Tensor, at::Tensor, int64_t>>>);
    REQUIRE(parts.size() == 2);
    CHECK(torch::equal(std::get<0>(parts[1]), x.narrow(0, 2, 2)));
    CHECK(std::get<2>(parts[1]) == 3);
    const auto back = torchdp::gather(parts, torch::kCPU);
    CHECK(torch::equal(std::get<1>(back), y));
  }
  SECTION("vectors and dicts") {
    const std::vector<at::Tensor> v{x, y};
    const auto parts = torchdp::scatter(v, cpu_devices(4));
    REQUIRE(parts.size() == 4);
    CHECK(parts[3].size() == 2);
    CHECK(torch::equal(torchdp::gather(parts, torch::kCPU)[0], x));
    c10::Dict<std::string, at::Tensor> d;
    d.insert("x", x);
    const auto dparts = torchdp::scatter(d, cpu_devices(2));
    CHECK(torch::equal(torchdp::gather(dparts, torch::kCPU).at("x"), x));
  }
  SECTION("an optional") {
    const auto parts = torchdp::scatter(std::optional<at::Tensor>(x), cpu_devices(2));
    CHECK(parts[0]->size(0) == 2);
    const auto none = torchdp::scatter(std::optional<at::Tensor>(), cpu_devices(2));
    REQUIRE(none.size() == 2);
    CHECK(!none[1].has_value());
  }
}

TEST_CASE("typed parallel_apply runs modules with several arguments", "[cpu][structure]") {
  torch::nn::Bilinear bilinear(3, 2, 4);
  const auto devices = cpu_devices(2);
  const auto x1 = torch::randn({6, 3});
  const auto x2 = torch::randn({6, 2});
  auto replicas = torchdp::replicate(bilinear, devices);
  const auto parts = torchdp::scatter(std::make_tuple(x1, x2), devices);
  const auto outputs = torchdp::parallel_apply(replicas, parts, devices);
  static_assert(std::is_same_v<decltype(outputs), const std::vector<at::Tensor>>);
  CHECK(torch::allclose(torchdp::gather(outputs, torch::kCPU), bilinear->forward(x1, x2), 1e-5,
                        1e-6));
}

TEST_CASE("scatter and gather on one GPU", "[cuda][structure]") {
  TORCHDP_NEED_CUDA(gpus, 1);
  const std::vector<torch::Device> devices{gpus[0], gpus[0]};
  const auto x = torch::randn({6, 3}, torch::requires_grad());
  const auto input = tuple_of({x, dict_of({{"k", c10::IValue(int64_t{4})}, {"x", x}})});
  const auto parts = torchdp::scatter(input, devices);
  REQUIRE(parts.size() == 2);
  CHECK(parts[1].toTupleRef().elements()[0].toTensor().device() == gpus[0]);
  const auto back = torchdp::gather(parts, torch::kCPU);
  const auto& e = back.toTupleRef().elements();
  CHECK(torch::equal(e[0].toTensor(), x));
  (e[0].toTensor().sum() + e[1].toGenericDict().at("x").toTensor().sum()).backward();
  CHECK(torch::allclose(x.grad(), torch::full_like(x, 2.0)));
}
