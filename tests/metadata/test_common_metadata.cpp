// CommonAttentionMetadata::validate (one test per rejected inconsistency, each checking that the
// message names the field and the index), the host accessors, and make_common_attention_metadata.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "metadata/metadata_test_util.h"
#include "pagedattn/device.h"
#include "pagedattn/metadata.h"

namespace pagedattn {
namespace {

using testing::batch_args;
using testing::expect_error_mentions;

constexpr int kBlockSize = 4;

// Four requests: query lens [3, 1, 7, 1], context lens [7, 4, 0, 19] -> seq lens [10, 5, 7, 20],
// query_start_loc [0, 3, 4, 11, 12]; block table 4 x 6 (5 columns needed + 1 spare).
class ValidateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(7);
    args_ = batch_args({3, 1, 7, 1}, {7, 4, 0, 19}, kBlockSize, 1, rng, &num_blocks_);
    owned_ = make_common_attention_metadata(args_, Device::cpu, num_blocks_, kBlockSize);
  }
  CommonAttentionMetadata& common() { return owned_.common; }
  void validate() { common().validate(num_blocks_, kBlockSize); }
  void expect_rejected(std::initializer_list<std::string> parts) {
    expect_error_mentions([&] { validate(); }, parts);
  }
  static int32_t* i32(Tensor& t) { return t.data_as<int32_t>(); }
  int32_t& table(int r, int c) { return i32(owned_.block_table)[r * args_.max_num_blocks_per_req + c]; }

  CommonAttentionMetadataArgs args_;
  int64_t num_blocks_ = 0;
  OwnedCommonAttentionMetadata owned_;
};

TEST_F(ValidateTest, AcceptsConsistentBatchAndDerivesFields) {
  EXPECT_NO_THROW(validate());
  EXPECT_NO_THROW(common().validate());  // all content checks that need a cache size skipped
  EXPECT_EQ(common().num_reqs, 4);
  EXPECT_EQ(common().num_actual_tokens, 12);
  EXPECT_EQ(common().max_query_len, 7);
  EXPECT_EQ(common().max_seq_len, 20);
  const int expected_q[] = {3, 1, 7, 1};
  const int expected_s[] = {10, 5, 7, 20};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(common().query_len(r), expected_q[r]);
    EXPECT_EQ(common().seq_len(r), expected_s[r]);
    EXPECT_EQ(common().num_computed_tokens(r), expected_s[r] - expected_q[r]);
  }
}

TEST_F(ValidateTest, AccessorsRejectRequestIndexOutOfRange) {
  expect_error_mentions([&] { (void)common().query_len(4); }, {"request index 4", "[0, 4)"});
  expect_error_mentions([&] { (void)common().seq_len(-1); }, {"request index -1"});
  expect_error_mentions([&] { (void)common().num_computed_tokens(7); }, {"request index 7"});
}

TEST_F(ValidateTest, RejectsQueryStartLocNotStartingAtZero) {
  i32(owned_.query_start_loc_cpu)[0] = 1;
  expect_rejected({"query_start_loc_cpu[0] = 1", "expected 0"});
}

TEST_F(ValidateTest, RejectsDecreasingQueryStartLoc) {
  i32(owned_.query_start_loc_cpu)[2] = 2;  // [0, 3, 2, 11, 12]
  expect_rejected({"query_start_loc_cpu[2] = 2", "query_start_loc_cpu[1] = 3", "non-decreasing",
                   "request 1"});
}

TEST_F(ValidateTest, RejectsSeqLenSmallerThanQueryLen) {
  i32(owned_.seq_lens_cpu)[2] = 5;  // query_len 7
  expect_rejected({"seq_lens_cpu[2] = 5", "smaller than query_len 7",
                   "query_start_loc_cpu[3] - query_start_loc_cpu[2]"});
}

TEST_F(ValidateTest, RejectsWrongNumComputedTokens) {
  i32(owned_.num_computed_tokens_cpu)[3] = 18;  // expected 20 - 1 = 19
  expect_rejected({"num_computed_tokens_cpu[3] = 18", "20 - 1 = 19"});
}

TEST_F(ValidateTest, RejectsWrongNumActualTokens) {
  common().num_actual_tokens = 11;
  expect_rejected({"num_actual_tokens = 11", "query_start_loc_cpu[num_reqs = 4] = 12"});
}

TEST_F(ValidateTest, RejectsWrongMaxQueryLenAndMaxSeqLen) {
  common().max_query_len = 6;
  expect_rejected({"max_query_len = 6", "(7)"});
  common().max_query_len = 7;
  common().max_seq_len = 21;
  expect_rejected({"max_seq_len = 21", "(20)"});
}

TEST_F(ValidateTest, RejectsNegativeNumReqs) {
  common().num_reqs = -1;
  expect_rejected({"num_reqs = -1"});
}

TEST_F(ValidateTest, RejectsBlockIdOutOfRange) {
  table(1, 1) = static_cast<int32_t>(num_blocks_);  // request 1 (seq 5) uses columns 0 and 1
  expect_rejected({"block_table_tensor[1][1] = " + std::to_string(num_blocks_),
                   "[0, " + std::to_string(num_blocks_) + ")", "request 1"});
  table(1, 1) = -3;
  expect_rejected({"block_table_tensor[1][1] = -3"});
}

TEST_F(ValidateTest, IgnoresBlockIdsPastTheColumnsARequestUses) {
  table(1, 2) = 999999;  // request 1 needs cdiv(5, 4) = 2 columns: column 2 is never read
  table(0, 5) = -7;      // spare column
  EXPECT_NO_THROW(validate());
  // Without a cache size the block ids are not checked at all.
  table(1, 0) = 999999;
  EXPECT_NO_THROW(common().validate());
  EXPECT_NO_THROW(common().validate(num_blocks_, 0));
}

TEST_F(ValidateTest, RejectsBlockTableNarrowerThanARequestNeeds) {
  // With block_size 2 request 3 (seq 20) needs 10 columns; the table has 6. (Checked only when
  // a cache size is given, like the block ids.)
  EXPECT_NO_THROW(common().validate(-1, 2));
  expect_error_mentions([&] { common().validate(num_blocks_, 2); },
                        {"block_table_tensor has 6 columns", "request 3", "seq_lens_cpu[3] = 20",
                         "= 10 blocks"});
}

TEST_F(ValidateTest, RejectsSlotOutOfRange) {
  const int64_t num_slots = num_blocks_ * kBlockSize;
  owned_.slot_mapping.data_as<int64_t>()[5] = num_slots;
  expect_rejected({"slot_mapping[5] = " + std::to_string(num_slots),
                   "expected -1 or a slot in [0, " + std::to_string(num_slots) + ")"});
  owned_.slot_mapping.data_as<int64_t>()[5] = -1;  // -1 = skip is always allowed
  EXPECT_NO_THROW(validate());
  owned_.slot_mapping.data_as<int64_t>()[0] = -2;
  expect_rejected({"slot_mapping[0] = -2"});
  // Without a cache size only negative slots other than -1 are rejected.
  expect_error_mentions([&] { common().validate(); }, {"slot_mapping[0] = -2"});
  owned_.slot_mapping.data_as<int64_t>()[0] = num_slots * 10;
  EXPECT_NO_THROW(common().validate());
}

TEST_F(ValidateTest, HugeNumBlocksDoesNotOverflowTheSlotRange) {
  // Found by fuzz/fuzz_common_metadata: the slot bound num_blocks * block_size overflowed int64
  // (undefined behaviour; in practice a negative bound that rejected every slot).
  const int64_t huge = std::numeric_limits<int64_t>::max();
  EXPECT_NO_THROW(common().validate(huge, kBlockSize));
  EXPECT_NO_THROW(common().validate(huge / 3, kBlockSize));
  owned_.slot_mapping.data_as<int64_t>()[0] = huge;  // below num_blocks * block_size
  EXPECT_NO_THROW(common().validate(huge, kBlockSize));
  owned_.slot_mapping.data_as<int64_t>()[0] = -2;
  expect_error_mentions([&] { common().validate(huge, kBlockSize); },
                        {"slot_mapping[0] = -2", "a slot in [0, 2^63)"});
}

TEST_F(ValidateTest, RejectsSlotMappingTailOtherThanMinusOne) {
  args_.num_tokens_padded = 16;
  owned_ = make_common_attention_metadata(args_, Device::cpu, num_blocks_, kBlockSize);
  EXPECT_NO_THROW(validate());
  owned_.slot_mapping.data_as<int64_t>()[14] = 3;  // num_actual_tokens = 12
  expect_rejected({"slot_mapping[14] = 3", "past num_actual_tokens = 12", "must be -1"});
}

TEST_F(ValidateTest, RejectsSlotMappingOfDtypeInt32) {
  Tensor slots32(Shape{12}, DType::i32);
  for (int i = 0; i < 12; ++i) slots32.data_as<int32_t>()[i] = i;
  common().slot_mapping = slots32.view();
  expect_rejected({"slot_mapping", "dtype", std::string(dtype_name(DType::i32)),
                   std::string(dtype_name(DType::i64))});
}

TEST_F(ValidateTest, RejectsWrongShapes) {
  const CommonAttentionMetadata good = common();
  // Host mirrors: exact sizes.
  common().seq_lens_cpu = owned_.seq_lens_cpu.view().narrow(0, 0, 3);
  expect_rejected({"seq_lens_cpu has shape", "(num_reqs,) = (4,)"});
  common() = good;
  common().num_computed_tokens_cpu = owned_.num_computed_tokens_cpu.view().reshape(Shape{2, 2});
  expect_rejected({"num_computed_tokens_cpu", "2 dimension(s)", "expected 1"});
  common() = good;
  common().query_start_loc_cpu = owned_.query_start_loc_cpu.view().narrow(0, 0, 4);
  expect_rejected({"query_start_loc_cpu", "(num_reqs + 1,) = (5,)"});
  common() = good;
  common().query_start_loc_cpu = TensorView();
  expect_rejected({"query_start_loc_cpu is not set"});
  // Device tensors: at least the sizes needed.
  common() = good;
  common().query_start_loc = owned_.query_start_loc.view().narrow(0, 0, 4);
  expect_rejected({"query_start_loc has shape", "at least num_reqs + 1 = 5"});
  common() = good;
  common().seq_lens = owned_.seq_lens.view().narrow(0, 0, 2);
  expect_rejected({"seq_lens has shape", "at least num_reqs = 4"});
  common() = good;
  common().block_table_tensor = owned_.block_table.view().narrow(0, 0, 3);
  expect_rejected({"block_table_tensor has shape", "at least num_reqs = 4 rows"});
  common() = good;
  common().block_table_tensor = owned_.block_table.view().reshape(Shape{24});
  expect_rejected({"block_table_tensor has 1 dimension(s)", "expected 2"});
  common() = good;
  common().slot_mapping = owned_.slot_mapping.view().narrow(0, 0, 11);
  expect_rejected({"slot_mapping has shape", "at least num_actual_tokens = 12"});
  common() = good;
  EXPECT_NO_THROW(validate());
}

TEST_F(ValidateTest, RejectsHostMirrorOnDevice) {
  // A view labelled cuda over host memory: validate must reject it without reading it.
  common().seq_lens_cpu = TensorView(owned_.seq_lens_cpu.data(), DType::i32, Shape{4}, Device::cuda);
  expect_rejected({"seq_lens_cpu is on cuda", "host mirrors must be on the cpu"});
}

TEST_F(ValidateTest, RejectsDeviceTensorsOnDifferentDevices) {
  common().block_table_tensor =
      TensorView(owned_.block_table.data(), DType::i32, Shape{4, 6}, Device::cuda);
  expect_rejected({"block_table_tensor is on cuda:0", "query_start_loc is on cpu:0"});
}

TEST_F(ValidateTest, DoesNotReadContentsOfCudaTensors) {
  // Garbage behind views labelled cuda (host memory, so a read would not crash but would fail
  // the content checks): validate checks only their dtype, shape and device.
  Tensor garbage_i32(Shape{64}, DType::i32);
  Tensor garbage_i64(Shape{16}, DType::i64);
  garbage_i32.fill_bytes(0xA5);
  garbage_i64.fill_bytes(0xA5);
  common().query_start_loc = TensorView(garbage_i32.data(), DType::i32, Shape{5}, Device::cuda);
  common().seq_lens = TensorView(garbage_i32.data_as<int32_t>() + 8, DType::i32, Shape{4}, Device::cuda);
  common().block_table_tensor =
      TensorView(garbage_i32.data_as<int32_t>() + 16, DType::i32, Shape{4, 6}, Device::cuda);
  common().slot_mapping = TensorView(garbage_i64.data(), DType::i64, Shape{16}, Device::cuda);
  EXPECT_NO_THROW(validate());
  // The host-side width check still applies (it reads only the mirrors).
  EXPECT_THROW(common().validate(num_blocks_, 2), Error);
  EXPECT_NO_THROW(common().validate(-1, 2));  // no cache size: block checks skipped
}

TEST_F(ValidateTest, RejectsCpuDeviceTensorDifferingFromItsMirror) {
  i32(owned_.query_start_loc)[2] = 5;
  expect_rejected({"query_start_loc[2] = 5", "query_start_loc_cpu[2] = 4"});
  i32(owned_.query_start_loc)[2] = 4;
  i32(owned_.seq_lens)[3] = 21;
  expect_rejected({"seq_lens[3] = 21", "seq_lens_cpu[3] = 20"});
}

TEST(MakeCommonAttentionMetadata, PadsSlotMappingTailWithMinusOne) {
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0, 2, 5};
  args.seq_lens = {4, 3};
  args.max_num_blocks_per_req = 2;
  args.block_table = {3, 1, 0, 2};
  // Entries past num_actual_tokens (5) are padding: replaced by -1 whatever they held.
  args.slot_mapping = {14, 15, 0, 1, 2, 77, 78};
  args.num_tokens_padded = 10;
  const OwnedCommonAttentionMetadata owned = make_common_attention_metadata(args, Device::cpu, 4, 4);
  ASSERT_EQ(owned.slot_mapping.numel(), 10);
  const int64_t* slots = owned.slot_mapping.data_as<int64_t>();
  const int64_t expected[] = {14, 15, 0, 1, 2, -1, -1, -1, -1, -1};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(slots[i], expected[i]) << "slot " << i;
  EXPECT_EQ(owned.common.slot_mapping.size(0), 10);
  // Without num_tokens_padded the given length is kept, tail still -1.
  args.num_tokens_padded = 0;
  const OwnedCommonAttentionMetadata kept = make_common_attention_metadata(args);
  ASSERT_EQ(kept.slot_mapping.numel(), 7);
  EXPECT_EQ(kept.slot_mapping.data_as<int64_t>()[4], 2);
  EXPECT_EQ(kept.slot_mapping.data_as<int64_t>()[5], -1);
  EXPECT_EQ(kept.slot_mapping.data_as<int64_t>()[6], -1);
}

TEST(MakeCommonAttentionMetadata, PadsRequests) {
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0, 3, 4};
  args.seq_lens = {9, 6};
  args.max_num_blocks_per_req = 3;
  args.block_table = {5, 6, 7, 8, 9, 10};
  args.slot_mapping = {-1, -1, -1, -1};
  args.num_reqs_padded = 4;
  const OwnedCommonAttentionMetadata owned = make_common_attention_metadata(args, Device::cpu, 11, 4);
  const CommonAttentionMetadata& c = owned.common;
  EXPECT_EQ(c.num_reqs, 2);
  EXPECT_EQ(c.query_start_loc.size(0), 5);
  EXPECT_EQ(c.seq_lens.size(0), 4);
  EXPECT_EQ(c.block_table_tensor.size(0), 4);
  EXPECT_EQ(c.block_table_tensor.size(1), 3);
  EXPECT_EQ(c.query_start_loc_cpu.size(0), 3);  // mirrors are exact
  EXPECT_EQ(c.seq_lens_cpu.size(0), 2);
  const int32_t* qsl = owned.query_start_loc.data_as<int32_t>();
  const int32_t expected_qsl[] = {0, 3, 4, 4, 4};  // padded requests have query_len 0
  for (int i = 0; i < 5; ++i) EXPECT_EQ(qsl[i], expected_qsl[i]);
  const int32_t* seq = owned.seq_lens.data_as<int32_t>();
  const int32_t expected_seq[] = {9, 6, 0, 0};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(seq[i], expected_seq[i]);
  const int32_t* table = owned.block_table.data_as<int32_t>();
  const int32_t expected_table[] = {5, 6, 7, 8, 9, 10, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < 12; ++i) EXPECT_EQ(table[i], expected_table[i]);
  EXPECT_EQ(owned.num_computed_tokens_cpu.data_as<int32_t>()[0], 6);
  EXPECT_EQ(owned.num_computed_tokens_cpu.data_as<int32_t>()[1], 5);
}

TEST(MakeCommonAttentionMetadata, ViewsSurviveMoves) {
  std::mt19937 rng(3);
  int64_t num_blocks = 0;
  const CommonAttentionMetadataArgs args = batch_args({2, 1}, {3, 9}, 4, 0, rng, &num_blocks);
  OwnedCommonAttentionMetadata first = make_common_attention_metadata(args, Device::cpu, num_blocks, 4);
  OwnedCommonAttentionMetadata moved = std::move(first);
  EXPECT_EQ(moved.common.seq_lens_cpu.data(), moved.seq_lens_cpu.data());
  EXPECT_EQ(moved.common.block_table_tensor.data(), moved.block_table.data());
  EXPECT_NO_THROW(moved.common.validate(num_blocks, 4));
  EXPECT_EQ(moved.common.seq_len(1), 10);
}

TEST(MakeCommonAttentionMetadata, EmptyBatch) {
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  args.num_tokens_padded = 4;
  const OwnedCommonAttentionMetadata owned = make_common_attention_metadata(args, Device::cpu, 8, 16);
  EXPECT_EQ(owned.common.num_reqs, 0);
  EXPECT_EQ(owned.common.num_actual_tokens, 0);
  EXPECT_EQ(owned.common.max_query_len, 0);
  EXPECT_EQ(owned.common.max_seq_len, 0);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(owned.slot_mapping.data_as<int64_t>()[i], -1);
  EXPECT_NO_THROW(owned.common.validate(8, 16));
}

TEST(MakeCommonAttentionMetadata, RejectsBadArguments) {
  CommonAttentionMetadataArgs good;
  good.query_start_loc = {0, 2, 5};
  good.seq_lens = {4, 3};
  good.max_num_blocks_per_req = 2;
  good.block_table = {3, 1, 0, 2};
  good.slot_mapping = {14, 15, 0, 1, 2};
  EXPECT_NO_THROW(make_common_attention_metadata(good, Device::cpu, 4, 4));

  auto with = [&](auto change) {
    CommonAttentionMetadataArgs a = good;
    change(a);
    return a;
  };
  expect_error_mentions([&] { make_common_attention_metadata(with([](auto& a) { a.query_start_loc.clear(); })); },
                        {"query_start_loc is empty"});
  expect_error_mentions([&] { make_common_attention_metadata(with([](auto& a) { a.seq_lens = {4}; })); },
                        {"seq_lens has 1 entries", "num_reqs = 2"});
  expect_error_mentions([&] { make_common_attention_metadata(with([](auto& a) { a.query_start_loc = {0, 3, 2}; })); },
                        {"query_start_loc[2] = 2", "non-decreasing"});
  expect_error_mentions([&] { make_common_attention_metadata(with([](auto& a) { a.block_table = {1, 2, 3}; })); },
                        {"block_table has 3 entries"});
  expect_error_mentions([&] { make_common_attention_metadata(with([](auto& a) { a.slot_mapping = {1, 2}; })); },
                        {"slot_mapping has 2 entries", "num_actual_tokens = 5"});
  expect_error_mentions([&] { make_common_attention_metadata(with([](auto& a) { a.num_tokens_padded = 4; })); },
                        {"num_tokens_padded = 4"});
  expect_error_mentions([&] { make_common_attention_metadata(with([](auto& a) { a.num_reqs_padded = 1; })); },
                        {"num_reqs_padded = 1"});
  // Content errors found by validate() name the request.
  expect_error_mentions([&] { make_common_attention_metadata(with([](auto& a) { a.seq_lens = {4, 2}; })); },
                        {"seq_lens_cpu[1] = 2", "query_len 3"});
  expect_error_mentions([&] { make_common_attention_metadata(good, Device::cpu, 3, 4); },
                        {"block_table_tensor[0][0] = 3", "[0, 3)"});
  expect_error_mentions([&] { make_common_attention_metadata(good, Device::cpu, 4, 2); },
                        {"slot_mapping[0] = 14", "[0, 8)"});
}

TEST(MakeCommonAttentionMetadata, CudaDeviceCopiesOrThrowsWithoutOne) {
  std::mt19937 rng(11);
  int64_t num_blocks = 0;
  const CommonAttentionMetadataArgs args = batch_args({2, 1, 4}, {3, 9, 0}, 4, 1, rng, &num_blocks);
  if (cuda_device_count() == 0) {
    EXPECT_THROW(make_common_attention_metadata(args, Device::cuda, num_blocks, 4), Error);
    return;
  }
  const OwnedCommonAttentionMetadata owned = make_common_attention_metadata(args, Device::cuda, num_blocks, 4);
  EXPECT_EQ(owned.common.query_start_loc.device(), Device::cuda);
  EXPECT_EQ(owned.common.slot_mapping.device(), Device::cuda);
  EXPECT_EQ(owned.common.seq_lens_cpu.device(), Device::cpu);
  const Tensor slots_back = owned.slot_mapping.to(Device::cpu);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(slots_back.data_as<int64_t>()[i], args.slot_mapping[i]);
}

TEST(MakeCommonAttentionMetadata, RandomBatchesAreValid) {
  std::mt19937 rng(2026);
  for (int trial = 0; trial < 200; ++trial) {
    const int num_reqs = std::uniform_int_distribution<int>(0, 12)(rng);
    const int block_size = 1 << std::uniform_int_distribution<int>(0, 5)(rng);
    std::vector<int32_t> q(static_cast<size_t>(num_reqs));
    std::vector<int32_t> ctx(static_cast<size_t>(num_reqs));
    for (int r = 0; r < num_reqs; ++r) {
      q[r] = std::uniform_int_distribution<int>(0, 40)(rng);
      ctx[r] = std::uniform_int_distribution<int>(0, 100)(rng);
    }
    int64_t num_blocks = 0;
    const CommonAttentionMetadataArgs args = batch_args(q, ctx, block_size, trial % 3, rng, &num_blocks);
    const OwnedCommonAttentionMetadata owned =
        make_common_attention_metadata(args, Device::cpu, num_blocks, block_size);
    int total = 0;
    for (int r = 0; r < num_reqs; ++r) {
      ASSERT_EQ(owned.common.query_len(r), q[r]);
      ASSERT_EQ(owned.common.num_computed_tokens(r), ctx[r]);
      total += q[r];
    }
    ASSERT_EQ(owned.common.num_actual_tokens, total);
  }
}

}  // namespace
}  // namespace pagedattn
