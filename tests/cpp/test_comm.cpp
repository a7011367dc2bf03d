#include "test_common.h"

#include <torchdp/comm.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

using torchdp_test::cpu_devices;

namespace {

const torch::Device kCpu(torch::kCPU);
const torch::Device kMeta(torch::kMeta);

/// True when `t`'s data lies inside `base`'s memory.
bool data_inside(const torch::Tensor& t, const torch::Tensor& base) {
  const auto* begin = static_cast<const char*>(base.data_ptr());
  const auto* end = begin + base.numel() * base.element_size();
  const auto* p = static_cast<const char*>(t.data_ptr());
  return p >= begin && p < end;
}

/// A float, an int64, a bool and a second float tensor, in that order.
std::vector<torch::Tensor> mixed_tensors() {
  return {torch::randn({2, 3}), torch::arange(4, torch::kLong) * 7,
          torch::tensor({true, false, true}), torch::randn({5})};
}

} // namespace

// ---------------------------------------------------------------------------------------------
// broadcast_coalesced

TEST_CASE("comm::broadcast_coalesced on CPU devices", "[cpu][comm]") {
  const auto n = GENERATE(as<size_t>{}, 1, 2, 3);
  const auto inputs = mixed_tensors();
  const auto out = torchdp::comm::broadcast_coalesced(inputs, cpu_devices(n));
  REQUIRE(out.size() == n);
  REQUIRE(out[0].size() == inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    // The first device gets the inputs themselves.
    CHECK(out[0][k].is_same(inputs[k]));
  }
  for (size_t j = 1; j < n; ++j) {
    REQUIRE(out[j].size() == inputs.size());
    for (size_t k = 0; k < inputs.size(); ++k) {
      INFO("device " << j << ", tensor " << k);
      const auto& copy = out[j][k];
      CHECK(copy.device() == kCpu);
      CHECK(copy.scalar_type() == inputs[k].scalar_type());
      CHECK(copy.sizes() == inputs[k].sizes());
      CHECK(torch::equal(copy, inputs[k]));
      CHECK(copy.data_ptr() != inputs[k].data_ptr());
      CHECK_FALSE(copy.is_alias_of(inputs[k]));
      CHECK_FALSE(copy.requires_grad());
      for (size_t i = 1; i < j; ++i) {
        CHECK_FALSE(copy.is_alias_of(out[i][k]));
      }
    }
  }
}

TEST_CASE("comm::broadcast_coalesced copies have their own version counters", "[cpu][comm]") {
  const auto inputs = mixed_tensors();
  const auto out = torchdp::comm::broadcast_coalesced(inputs, cpu_devices(3));
  const auto input_version = inputs[0]._version();
  const auto sibling_version = out[1][3]._version(); // same dtype, so same bucket as out[1][0]
  const auto other_copy_version = out[2][0]._version();
  const auto before = inputs[0].clone();

  out[1][0].add_(1);
  CHECK(inputs[0]._version() == input_version);
  CHECK(out[1][3]._version() == sibling_version);
  CHECK(out[2][0]._version() == other_copy_version);
  CHECK(out[1][0]._version() > 0);
  // The write stays in that copy.
  CHECK(torch::equal(inputs[0], before));
  CHECK(torch::equal(out[2][0], before));
  CHECK(torch::allclose(out[1][0], before + 1));
}

TEST_CASE("comm::broadcast_coalesced to [cpu, meta]", "[cpu][comm]") {
  const auto inputs = mixed_tensors();
  const auto out = torchdp::comm::broadcast_coalesced(inputs, {kCpu, kMeta});
  REQUIRE(out.size() == 2);
  REQUIRE(out[1].size() == inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    INFO("tensor " << k);
    CHECK(out[0][k].is_same(inputs[k]));
    CHECK(out[1][k].device().is_meta());
    CHECK(out[1][k].sizes() == inputs[k].sizes());
    CHECK(out[1][k].scalar_type() == inputs[k].scalar_type());
  }
}

TEST_CASE("comm::broadcast_coalesced with small buckets", "[cpu][comm]") {
  // Four float tensors of 16 bytes each.
  std::vector<torch::Tensor> inputs;
  for (int i = 0; i < 4; ++i) {
    inputs.push_back(torch::randn({4}));
  }
  SECTION("one bucket per tensor") {
    const auto out = torchdp::comm::broadcast_coalesced(inputs, cpu_devices(3), /*buffer_size=*/1);
    for (size_t j = 1; j < 3; ++j) {
      for (size_t k = 0; k < inputs.size(); ++k) {
        CHECK(torch::equal(out[j][k], inputs[k]));
        for (size_t other = 0; other < k; ++other) {
          CHECK_FALSE(out[j][k].is_alias_of(out[j][other]));
        }
      }
    }
  }
  SECTION("two tensors per bucket") {
    const auto out = torchdp::comm::broadcast_coalesced(inputs, cpu_devices(2), /*buffer_size=*/32);
    for (size_t k = 0; k < inputs.size(); ++k) {
      CHECK(torch::equal(out[1][k], inputs[k]));
    }
    CHECK(out[1][0].is_alias_of(out[1][1]));
    CHECK(out[1][2].is_alias_of(out[1][3]));
    CHECK_FALSE(out[1][1].is_alias_of(out[1][2]));
  }
  SECTION("default buffer size: one bucket") {
    const auto out = torchdp::comm::broadcast_coalesced(inputs, cpu_devices(2));
    for (size_t k = 0; k < inputs.size(); ++k) {
      CHECK(torch::equal(out[1][k], inputs[k]));
      CHECK(out[1][k].is_alias_of(out[1][0]));
    }
  }
}

TEST_CASE("comm::broadcast_coalesced keeps the order of mixed dtypes", "[cpu][comm]") {
  const std::vector<torch::Tensor> inputs{torch::tensor({1.5F, 2.5F}),
                                          torch::tensor({int64_t{10}, int64_t{20}}),
                                          torch::tensor({true, false}),
                                          torch::tensor({3.5F}),
                                          torch::tensor({int64_t{30}}),
                                          torch::randn({2, 2}, torch::kDouble),
                                          torch::tensor({false, false, true}),
                                          torch::randn({3, 1}),
                                          torch::randn({2}, torch::kComplexFloat),
                                          torch::randn({3}).to(torch::kBFloat16)};
  const auto buffer_size = GENERATE(as<size_t>{}, 1, 9, torchdp::comm::kDefaultBufferSize);
  const auto out = torchdp::comm::broadcast_coalesced(inputs, cpu_devices(2), buffer_size);
  REQUIRE(out[1].size() == inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    INFO("buffer_size " << buffer_size << ", tensor " << k);
    CHECK(out[1][k].scalar_type() == inputs[k].scalar_type());
    CHECK(out[1][k].sizes() == inputs[k].sizes());
    CHECK(torch::equal(out[1][k], inputs[k]));
  }
}

TEST_CASE("comm::broadcast_coalesced handles empty and non-contiguous tensors", "[cpu][comm]") {
  const auto base = torch::arange(12, torch::kFloat).reshape({3, 4});
  const std::vector<torch::Tensor> inputs{torch::empty({0}), base.t(), torch::empty({2, 0}),
                                          base.select(1, 2), torch::ones({1})};
  const auto out = torchdp::comm::broadcast_coalesced(inputs, cpu_devices(3));
  for (size_t j = 1; j < 3; ++j) {
    REQUIRE(out[j].size() == inputs.size());
    for (size_t k = 0; k < inputs.size(); ++k) {
      INFO("device " << j << ", tensor " << k);
      CHECK(out[j][k].sizes() == inputs[k].sizes());
      CHECK(torch::equal(out[j][k], inputs[k]));
    }
  }

  const auto none = torchdp::comm::broadcast_coalesced({}, cpu_devices(3));
  REQUIRE(none.size() == 3);
  for (const auto& list : none) {
    CHECK(list.empty());
  }
}

TEST_CASE("comm::broadcast_coalesced copies sparse tensors", "[cpu][comm]") {
  const auto dense = torch::tensor({{0.F, 2.F, 0.F}, {3.F, 0.F, 4.F}});
  const auto sparse = dense.to_sparse();
  const auto other = torch::randn({2});
  const auto out = torchdp::comm::broadcast_coalesced({sparse, other}, cpu_devices(2));
  CHECK(out[0][0].is_same(sparse));
  CHECK(out[1][0].is_sparse());
  CHECK(torch::equal(out[1][0].to_dense(), dense));
  CHECK(torch::equal(out[1][1], other));
}

TEST_CASE("comm::broadcast_coalesced errors", "[cpu][comm]") {
  const auto x = torch::randn({2});
  TORCHDP_CHECK_THROWS_WITH(torchdp::comm::broadcast_coalesced({x}, {}),
                            "torchdp::comm::broadcast_coalesced", "empty device list");
  // The second tensor is on meta but devices[0] is the CPU.
  const auto m = torch::empty({2}, torch::TensorOptions().device(kMeta));
  TORCHDP_CHECK_THROWS_WITH(torchdp::comm::broadcast_coalesced({x, m}, cpu_devices(2)),
                            "torchdp::comm::broadcast_coalesced", "tensor 1 is on meta",
                            "must be on cpu (devices[0])");
  TORCHDP_CHECK_THROWS_WITH(torchdp::comm::broadcast_coalesced({x}, {kMeta, kCpu}),
                            "torchdp::comm::broadcast_coalesced", "tensor 0 is on cpu",
                            "must be on meta (devices[0])");
  TORCHDP_CHECK_THROWS_WITH(torchdp::comm::broadcast_coalesced({x}, cpu_devices(2), 0),
                            "torchdp::comm::broadcast_coalesced", "buffer_size must be positive");
  TORCHDP_CHECK_THROWS_WITH(
      torchdp::comm::broadcast_coalesced({x, torch::Tensor()}, cpu_devices(2)),
      "torchdp::comm::broadcast_coalesced", "tensor 1 is an undefined tensor");
  TORCHDP_CHECK_THROWS_WITH(torchdp::comm::broadcast_coalesced({x}, {kCpu, torch::Device("xpu")}),
                            "torchdp::comm::broadcast_coalesced", "xpu", "not supported");
}

// ---------------------------------------------------------------------------------------------
// reduce_add_coalesced

TEST_CASE("comm::reduce_add_coalesced sums per position", "[cpu][comm]") {
  const size_t n = GENERATE(as<size_t>{}, 1, 2, 4);
  const auto buffer_size = GENERATE(as<size_t>{}, 1, torchdp::comm::kDefaultBufferSize);
  std::vector<std::vector<torch::Tensor>> per_device;
  for (size_t j = 0; j < n; ++j) {
    per_device.push_back({torch::randn({2, 3}),
                          torch::arange(5, torch::kLong) * static_cast<int64_t>(j + 1),
                          torch::randn({4}, torch::kDouble), torch::randn({3, 2}).t(),
                          torch::randn({2}, torch::kComplexDouble)});
  }
  std::vector<std::vector<torch::Tensor>> before;
  for (const auto& list : per_device) {
    std::vector<torch::Tensor> copies;
    for (const auto& t : list) {
      copies.push_back(t.clone());
    }
    before.push_back(copies);
  }

  const auto out = torchdp::comm::reduce_add_coalesced(per_device, kCpu, buffer_size);
  REQUIRE(out.size() == 5);
  for (size_t k = 0; k < out.size(); ++k) {
    INFO("n " << n << ", buffer_size " << buffer_size << ", tensor " << k);
    auto expected = per_device[0][k].clone();
    for (size_t j = 1; j < n; ++j) {
      expected += per_device[j][k];
    }
    CHECK(out[k].scalar_type() == per_device[0][k].scalar_type());
    CHECK(out[k].sizes() == per_device[0][k].sizes());
    CHECK(out[k].device() == kCpu);
    CHECK(torch::allclose(out[k], expected));
    for (size_t j = 0; j < n; ++j) {
      CHECK_FALSE(out[k].is_alias_of(per_device[j][k]));
      // The inputs are left as they were.
      CHECK(torch::equal(per_device[j][k], before[j][k]));
    }
  }
}

TEST_CASE("comm::reduce_add_coalesced results never alias an input", "[cpu][comm]") {
  // A single contiguous tensor per bucket is the case where the flat buffer is the input itself.
  const auto a = torch::randn({3});
  const auto b = torch::randn({3});
  const auto out_one = torchdp::comm::reduce_add_coalesced({{a}}, kCpu);
  REQUIRE(out_one.size() == 1);
  CHECK_FALSE(out_one[0].is_alias_of(a));
  CHECK(torch::equal(out_one[0], a));
  const auto a_before = a.clone();
  out_one[0].add_(100);
  CHECK(torch::equal(a, a_before));

  const auto out_two = torchdp::comm::reduce_add_coalesced({{a}, {b}}, kCpu);
  CHECK_FALSE(out_two[0].is_alias_of(a));
  CHECK_FALSE(out_two[0].is_alias_of(b));
  CHECK(torch::allclose(out_two[0], a + b));
  CHECK(torch::equal(a, a_before));
}

TEST_CASE("comm::reduce_add_coalesced to a meta destination", "[cpu][comm]") {
  const auto out =
      torchdp::comm::reduce_add_coalesced({{torch::randn({2, 2}), torch::ones({3}, torch::kLong)},
                                           {torch::randn({2, 2}), torch::ones({3}, torch::kLong)}},
                                          kMeta);
  REQUIRE(out.size() == 2);
  CHECK(out[0].device().is_meta());
  CHECK(out[0].sizes() == torch::IntArrayRef({2, 2}));
  CHECK(out[1].device().is_meta());
  CHECK(out[1].scalar_type() == torch::kLong);
}

TEST_CASE("comm::reduce_add_coalesced with empty lists", "[cpu][comm]") {
  const auto out = torchdp::comm::reduce_add_coalesced({{}, {}, {}}, kCpu);
  CHECK(out.empty());
}

TEST_CASE("comm::reduce_add_coalesced sums sparse tensors", "[cpu][comm]") {
  const auto d0 = torch::tensor({{0.F, 1.F}, {2.F, 0.F}});
  const auto d1 = torch::tensor({{5.F, 0.F}, {1.F, 0.F}});
  const auto out = torchdp::comm::reduce_add_coalesced({{d0.to_sparse()}, {d1.to_sparse()}}, kCpu);
  REQUIRE(out.size() == 1);
  CHECK(torch::equal(out[0].to_dense(), d0 + d1));
}

TEST_CASE("comm::reduce_add_coalesced errors", "[cpu][comm]") {
  const char* api = "torchdp::comm::reduce_add_coalesced";
  SECTION("size mismatch") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::reduce_add_coalesced({{torch::ones({2, 3})}, {torch::ones({3, 2})}}, kCpu),
        api, "input 0 of list 1 has invalid size", "got [3, 2]", "expected [2, 3]");
  }
  SECTION("dtype mismatch") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::reduce_add_coalesced({{torch::ones({2}), torch::ones({2})},
                                             {torch::ones({2}), torch::ones({2})},
                                             {torch::ones({2}), torch::ones({2}, torch::kDouble)}},
                                            kCpu),
        api, "input 1 of list 2 has dtype Double", "expected Float");
  }
  SECTION("list length mismatch") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::reduce_add_coalesced(
                                  {{torch::ones({2}), torch::ones({2})}, {torch::ones({2})}}, kCpu),
                              api, "same number of tensors", "list 0 has 2", "list 1 has 1");
  }
  SECTION("no lists") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::reduce_add_coalesced({}, kCpu), api,
                              "at least one list");
  }
  SECTION("a list mixing devices") {
    const auto m = torch::empty({2}, torch::TensorOptions().device(kMeta));
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::reduce_add_coalesced({{torch::ones({2}), m}, {torch::ones({2}), m}}, kCpu),
        api, "list 0 mixes devices", "cpu", "meta");
  }
  SECTION("zero buffer size") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::reduce_add_coalesced({{torch::ones({2})}}, kCpu, /*buffer_size=*/0), api,
        "buffer_size must be positive");
  }
  SECTION("unsupported destination") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::reduce_add_coalesced({{torch::ones({2})}}, torch::Device("xpu")), api, "xpu",
        "not supported");
  }
}

// ---------------------------------------------------------------------------------------------
// scatter

TEST_CASE("comm::scatter follows chunk semantics", "[cpu][comm]") {
  struct Case {
    int64_t rows;
    size_t devices;
    std::vector<int64_t> sizes;
  };
  // torch.chunk gives chunks of ceil(rows / devices) rows, so there may be fewer than devices.
  const auto c = GENERATE(values<Case>({
      {8, 4, {2, 2, 2, 2}},
      {5, 4, {2, 2, 1}},
      {3, 4, {1, 1, 1}},
      {6, 4, {2, 2, 2}},
      {7, 3, {3, 3, 1}},
      {1, 3, {1}},
      {4, 1, {4}},
  }));
  const auto x = torch::randn({c.rows, 3});
  const auto chunks = torchdp::comm::scatter(x, cpu_devices(c.devices));
  INFO("rows " << c.rows << ", devices " << c.devices);
  REQUIRE(chunks.size() == c.sizes.size());
  int64_t offset = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    CHECK(chunks[i].size(0) == c.sizes[i]);
    CHECK(chunks[i].size(1) == 3);
    CHECK(torch::equal(chunks[i], x.narrow(0, offset, c.sizes[i])));
    offset += c.sizes[i];
  }
}

TEST_CASE("comm::scatter chunks on the input's device are views of it", "[cpu][comm]") {
  const auto x = torch::randn({6, 2});
  const auto chunks = torchdp::comm::scatter(x, cpu_devices(3));
  REQUIRE(chunks.size() == 3);
  for (const auto& chunk : chunks) {
    CHECK(chunk.is_alias_of(x));
    CHECK(data_inside(chunk, x));
    CHECK_FALSE(chunk.requires_grad());
  }
  // A write to the input shows through the views.
  x.select(0, 5).fill_(42);
  CHECK(torch::equal(chunks[2].select(0, 1), torch::full({2}, 42.F)));
}

TEST_CASE("comm::scatter to [cpu, meta]", "[cpu][comm]") {
  const auto x = torch::randn({4, 2});
  const auto chunks = torchdp::comm::scatter(x, {kCpu, kMeta});
  REQUIRE(chunks.size() == 2);
  CHECK(chunks[0].device() == kCpu);
  CHECK(chunks[0].is_alias_of(x));
  CHECK(torch::equal(chunks[0], x.narrow(0, 0, 2)));
  CHECK(chunks[1].device().is_meta());
  CHECK(chunks[1].sizes() == torch::IntArrayRef({2, 2}));
}

TEST_CASE("comm::scatter with chunk_sizes", "[cpu][comm]") {
  const auto x = torch::arange(16, torch::kFloat).reshape({8, 2});
  const std::vector<int64_t> sizes{1, 3, 0, 4};
  const auto chunks = torchdp::comm::scatter(x, cpu_devices(4), sizes);
  REQUIRE(chunks.size() == 4);
  int64_t offset = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    INFO("chunk " << i);
    CHECK(chunks[i].size(0) == sizes[i]);
    CHECK(torch::equal(chunks[i], x.narrow(0, offset, sizes[i])));
    offset += sizes[i];
  }
}

TEST_CASE("comm::scatter along other and negative dims", "[cpu][comm]") {
  const auto x = torch::randn({2, 6, 3});
  const auto dim = GENERATE(as<int64_t>{}, 1, -2);
  const auto chunks = torchdp::comm::scatter(x, cpu_devices(3), std::nullopt, dim);
  const auto expected = x.chunk(3, 1);
  REQUIRE(chunks.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(chunks[i].sizes() == torch::IntArrayRef({2, 2, 3}));
    CHECK(torch::equal(chunks[i], expected[i]));
  }

  const auto last = torchdp::comm::scatter(x, cpu_devices(2), std::vector<int64_t>{1, 2}, -1);
  REQUIRE(last.size() == 2);
  CHECK(torch::equal(last[0], x.narrow(2, 0, 1)));
  CHECK(torch::equal(last[1], x.narrow(2, 1, 2)));
}

TEST_CASE("comm::scatter errors", "[cpu][comm]") {
  const char* api = "torchdp::comm::scatter";
  const auto x = torch::randn({8, 2});
  SECTION("0-dim input") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::scatter(torch::tensor(3.F), cpu_devices(2)), api,
                              "0-dim");
  }
  SECTION("chunk_sizes length") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::scatter(x, cpu_devices(2), std::vector<int64_t>{2, 2, 4}), api,
        "same length", "2 devices and 3 chunk sizes");
  }
  SECTION("chunk_sizes sum") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::scatter(x, cpu_devices(3), std::vector<int64_t>{2, 2, 3}), api, "[2, 2, 3]",
        "add up to 7", "dimension 0 of the input has size 8");
  }
  SECTION("negative chunk size") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::scatter(x, cpu_devices(3), std::vector<int64_t>{5, -1, 4}), api,
        "chunk size 1 is negative (-1)");
  }
  SECTION("empty device list") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::scatter(x, {}), api, "empty device list");
  }
  SECTION("undefined input") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::scatter(torch::Tensor(), cpu_devices(2)), api,
                              "undefined");
  }
  SECTION("dim out of range") {
    CHECK_THROWS_AS(torchdp::comm::scatter(x, cpu_devices(2), std::nullopt, 2), c10::IndexError);
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::scatter(x, cpu_devices(2), std::nullopt, -3), api,
                              "dim -3 is out of range", "[8, 2]", "[-2, 1]");
  }
  SECTION("sparse input") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::scatter(torch::eye(4).to_sparse(), cpu_devices(2)),
                              api, "layout Sparse", "to_dense()");
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::gather({torch::eye(2).to_sparse(), torch::eye(2).to_sparse()}, kCpu),
        "torchdp::comm::gather", "tensor 0 has layout Sparse");
  }
  SECTION("quantized input") {
    const auto q = torch::quantize_per_tensor(torch::rand({4, 2}), 0.1, 0, torch::kQInt8);
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::scatter(q, cpu_devices(2)), api, "quantized",
                              "dequantize it first");
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::broadcast_coalesced({q}, cpu_devices(2)),
                              "torchdp::comm::broadcast_coalesced", "tensor 0 is a quantized");
  }
  SECTION("meta input to devices with data") {
    const auto m = torch::empty({4, 2}, torch::kMeta);
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::scatter(m, {kCpu, kCpu}), api, "meta device",
                              "cannot be copied to cpu");
    CHECK(torchdp::comm::scatter(m, {torch::kMeta, torch::kMeta})[1].is_meta());
  }
}

// ---------------------------------------------------------------------------------------------
// gather

TEST_CASE("comm::gather concatenates", "[cpu][comm]") {
  const std::vector<torch::Tensor> rows{torch::randn({2, 3}), torch::randn({1, 3}),
                                        torch::randn({4, 3})};
  const auto out = torchdp::comm::gather(rows, kCpu);
  CHECK(out.sizes() == torch::IntArrayRef({7, 3}));
  CHECK(torch::equal(out, torch::cat(rows, 0)));
  for (const auto& t : rows) {
    CHECK_FALSE(out.is_alias_of(t));
  }

  const std::vector<torch::Tensor> cols{torch::randn({2, 1}), torch::randn({2, 4})};
  const auto dim = GENERATE(as<int64_t>{}, 1, -1);
  const auto out_cols = torchdp::comm::gather(cols, kCpu, dim);
  CHECK(out_cols.sizes() == torch::IntArrayRef({2, 5}));
  CHECK(torch::equal(out_cols, torch::cat(cols, 1)));

  // A single tensor is copied, not returned.
  const auto single = torchdp::comm::gather({rows[0]}, kCpu);
  CHECK(torch::equal(single, rows[0]));
  CHECK_FALSE(single.is_alias_of(rows[0]));
}

TEST_CASE("comm::gather keeps a common memory format", "[cpu][comm]") {
  const auto a = torch::randn({2, 3, 4, 5}).contiguous(torch::MemoryFormat::ChannelsLast);
  const auto b = torch::randn({1, 3, 4, 5}).contiguous(torch::MemoryFormat::ChannelsLast);
  const auto out = torchdp::comm::gather({a, b}, kCpu);
  CHECK(out.is_contiguous(torch::MemoryFormat::ChannelsLast));
  CHECK(torch::equal(out, torch::cat({a, b}, 0)));

  const auto mixed = torchdp::comm::gather({a, b.contiguous()}, kCpu);
  CHECK(mixed.is_contiguous());
  CHECK(torch::equal(mixed, torch::cat({a, b}, 0)));
}

TEST_CASE("comm::gather to a meta destination", "[cpu][comm]") {
  const auto out = torchdp::comm::gather({torch::randn({2, 3}), torch::randn({3, 3})}, kMeta);
  CHECK(out.device().is_meta());
  CHECK(out.sizes() == torch::IntArrayRef({5, 3}));
  CHECK(out.scalar_type() == torch::kFloat);
}

TEST_CASE("comm::scatter then comm::gather round-trips", "[cpu][comm]") {
  const auto x = torch::randn({7, 4});
  const auto dim = GENERATE(as<int64_t>{}, 0, 1, -1);
  const auto n = GENERATE(as<size_t>{}, 1, 3, 4);
  const auto chunks = torchdp::comm::scatter(x, cpu_devices(n), std::nullopt, dim);
  CHECK(torch::equal(torchdp::comm::gather(chunks, kCpu, dim), x));
}

TEST_CASE("comm::gather errors", "[cpu][comm]") {
  const char* api = "torchdp::comm::gather";
  SECTION("shape mismatch") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::gather({torch::ones({2, 3}), torch::ones({2, 3}), torch::ones({2, 4})},
                              kCpu),
        api, "input tensor at index 2", "invalid shape [2, 4]", "expected [2, 3]", "dim=0");
  }
  SECTION("shape mismatch along a negative dim") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::gather({torch::ones({2, 3}), torch::ones({4, 1})}, kCpu, -1), api,
        "input tensor at index 1", "invalid shape [4, 1]", "expected [2, 1]", "dim=1");
  }
  SECTION("rank mismatch") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::gather({torch::ones({2, 3}), torch::ones({6})}, kCpu),
                              api, "input tensor at index 1", "invalid shape [6]");
  }
  SECTION("dtype mismatch") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::gather({torch::ones({2}), torch::ones({2}, torch::kLong)}, kCpu), api,
        "tensor 1 has dtype Long", "tensor 0 has Float");
  }
  SECTION("no tensors") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::gather({}, kCpu), api, "at least one tensor");
  }
  SECTION("0-dim tensors") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::gather({torch::tensor(1.F), torch::tensor(2.F)}, kCpu),
                              api, "cannot gather 0-dim tensors");
  }
  SECTION("dim out of range") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::gather({torch::ones({2, 3}), torch::ones({1, 3})}, kCpu, 2), api,
        "dim 2 is out of range", "[2, 3]", "[-2, 1]");
  }
  SECTION("unsupported destination") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::gather({torch::ones({2})}, torch::Device("xpu")), api,
                              "xpu", "not supported");
  }
}

TEST_CASE("comm::gather pads other dimensions with a pad value", "[cpu][comm]") {
  // Token ids of different lengths along dim 1, gathered along dim 0.
  const auto a = torch::tensor({1, 2, 3, 4}, torch::kLong).view({2, 2});
  const auto b = torch::tensor({5, 6, 7}, torch::kLong).view({1, 3});
  const auto c = torch::tensor({8}, torch::kLong).view({1, 1});
  const auto out = torchdp::comm::gather({a, b, c}, kCpu, 0, /*pad_value=*/-1);
  const auto expected =
      torch::tensor({1, 2, -1, 3, 4, -1, 5, 6, 7, 8, -1, -1}, torch::kLong).view({4, 3});
  CHECK(torch::equal(out, expected));

  SECTION("along a negative dim, padding two dimensions") {
    const auto x = torch::ones({2, 1, 3});
    const auto y = torch::full({1, 2, 2}, 2.F);
    const auto joined = torchdp::comm::gather({x, y}, kCpu, -1, 0.5);
    REQUIRE(joined.sizes() == torch::IntArrayRef({2, 2, 5}));
    CHECK(torch::equal(joined.narrow(2, 0, 3).narrow(1, 0, 1), x));
    CHECK(torch::equal(joined.narrow(2, 3, 2).narrow(0, 0, 1), y));
    CHECK(torch::all(joined.narrow(2, 0, 3).narrow(1, 1, 1) == 0.5).item<bool>());
    CHECK(torch::all(joined.narrow(2, 3, 2).narrow(0, 1, 1) == 0.5).item<bool>());
  }
  SECTION("equal sizes are concatenated as without it") {
    CHECK(torch::equal(torchdp::comm::gather({a, a}, kCpu, 0, 9), torch::cat({a, a})));
  }
  SECTION("to a meta destination") {
    const auto meta = torchdp::comm::gather({a, b}, kMeta, 0, 0);
    CHECK(meta.device().is_meta());
    CHECK(meta.sizes() == torch::IntArrayRef({3, 3}));
  }
}

TEST_CASE("comm::gather pad value errors", "[cpu][comm]") {
  const char* api = "torchdp::comm::gather";
  const auto a = torch::ones({1, 2}, torch::kLong);
  const auto b = torch::ones({1, 3}, torch::kLong);
  SECTION("without a pad value the error names the option") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::gather({a, b}, kCpu), api, "invalid shape [1, 3]",
                              "give a pad value (pad_value)");
  }
  SECTION("a different number of dimensions is not padded") {
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::gather({a, torch::ones({1, 2, 1}, torch::kLong)}, kCpu, 0, 0), api,
        "input tensor at index 1", "invalid shape [1, 2, 1]");
  }
  SECTION("a pad value the dtype cannot hold") {
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::gather({a, b}, kCpu, 0, 0.5), api, "pad value 0.5",
                              "Long", "pad_token_id");
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::gather({a.to(torch::kByte), b.to(torch::kByte)}, kCpu, 0, -1), api,
        "pad value -1", "Byte");
    TORCHDP_CHECK_THROWS_WITH(
        torchdp::comm::gather({a.to(torch::kBool), b.to(torch::kBool)}, kCpu, 0, 2), api,
        "pad value 2", "Bool");
    // Checked whatever the shapes, so the error does not depend on the data.
    TORCHDP_CHECK_THROWS_WITH(torchdp::comm::gather({a, a}, kCpu, 0, 0.5), api, "pad value 0.5");
  }
}

TEST_CASE("comm::reduce_add_coalesced sums sparse tensors sparsely, with a dense one densely",
          "[cpu][comm]") {
  const auto dense = torch::randn({4, 3});
  const auto s1 = torch::randn({4, 3}).relu().to_sparse();
  const auto s2 = torch::randn({4, 3}).relu().to_sparse();
  const auto other = torch::randn({5});
  // A sparse embedding gradient from every replica: the sum stays sparse.
  const auto all_sparse = torchdp::comm::reduce_add_coalesced({{s1, other}, {s2, other}}, kCpu);
  REQUIRE(all_sparse.size() == 2);
  CHECK(all_sparse[0].is_sparse());
  CHECK(torch::allclose(all_sparse[0].to_dense(), s1.to_dense() + s2.to_dense()));
  CHECK(torch::allclose(all_sparse[1], other * 2));
  // A dense one among them, first or not: the sum is dense (sparse + dense has no kernel).
  for (const bool dense_first : {true, false}) {
    INFO("dense first: " << dense_first);
    std::vector<std::vector<torch::Tensor>> per_device = {{dense, other}, {s1, other}, {s2, other}};
    if (!dense_first) {
      std::swap(per_device[0], per_device[2]);
    }
    const auto mixed = torchdp::comm::reduce_add_coalesced(per_device, kCpu);
    CHECK_FALSE(mixed[0].is_sparse());
    CHECK(torch::allclose(mixed[0], dense + s1.to_dense() + s2.to_dense()));
    CHECK_FALSE(mixed[0].is_alias_of(dense));
    CHECK(torch::allclose(mixed[1], other * 3));
  }
}
