// SelfComm, ThreadComm (1..4 thread-ranks) and SliceForRank.
#include "engine/comm/comm.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <thread>

namespace qcal::comm {
namespace {

// Runs fn(comm) on one thread per rank and returns each rank's status.
std::vector<Status> RunRanks(int n, const std::function<Status(Comm&)>& fn) {
  auto comms = MakeThreadComms(n);
  std::vector<Status> status(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      status[r] = fn(*comms[r]);
      if (!status[r].ok()) comms[r].reset();  // a failed rank leaves: the others must not hang
    });
  }
  for (auto& t : threads) t.join();
  return status;
}

TEST(SliceForRankTest, CoversEveryItemOnceFirstRanksGetTheRemainder) {
  for (int64_t total : {0, 1, 5, 7, 64}) {
    for (int size : {1, 2, 3, 4, 8}) {
      int64_t next = 0;
      for (int r = 0; r < size; ++r) {
        const Range range = SliceForRank(total, r, size);
        EXPECT_EQ(range.begin, next) << total << " " << r << "/" << size;
        EXPECT_EQ(range.size(), total / size + (r < total % size ? 1 : 0));
        next = range.end;
      }
      EXPECT_EQ(next, total);
    }
  }
  EXPECT_EQ(SliceForRank(7, 0, 3).end, 3);
  EXPECT_EQ(SliceForRank(7, 2, 3).begin, 5);
  EXPECT_EQ(SliceForRank(7, 3, 3).size(), 0);  // not a rank
}

TEST(SelfCommTest, IsAWorldOfOne) {
  auto comm = MakeSelfComm();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  int64_t v[2] = {3, -4};
  ASSERT_TRUE(comm->AllReduceSum(v, 2).ok());
  EXPECT_EQ(v[1], -4);
  std::vector<char> out;
  ASSERT_TRUE(comm->Gather("abc", 3, 0, &out).ok());
  EXPECT_EQ(std::string(out.begin(), out.end()), "abc");
  EXPECT_FALSE(comm->Broadcast(v, 8, 1).ok());
}

class ThreadCommTest : public ::testing::TestWithParam<int> {};

TEST_P(ThreadCommTest, CollectivesGiveEveryRankTheSameResult) {
  const int n = GetParam();
  std::vector<std::vector<int64_t>> isums(n);
  std::vector<std::vector<double>> dsums(n);
  std::vector<std::vector<char>> gathered(n);
  std::vector<std::string> bcast(n);
  std::vector<std::vector<char>> all_gathered(n);
  std::vector<std::vector<size_t>> all_sizes(n);
  auto status = RunRanks(n, [&](Comm& c) -> Status {
    const int r = c.rank();
    EXPECT_EQ(c.size(), n);
    EXPECT_EQ(c.name(), "threads");
    // Large values: exact integer sums, no wraparound below 2^63.
    std::vector<int64_t> iv = {r + 1, -(int64_t{1} << 40) * (r + 1), int64_t{1} << 60};
    if (r > 0) iv[2] = 0;
    QCAL_RETURN_IF_ERROR(c.AllReduceSum(iv.data(), iv.size()));
    isums[r] = iv;
    std::vector<double> dv = {0.1 * (r + 1), 1e300, -1.0};
    QCAL_RETURN_IF_ERROR(c.AllReduceSum(dv.data(), dv.size()));
    dsums[r] = dv;
    // Several rounds: the rendezvous must be reusable back to back.
    for (int round = 0; round < 20; ++round) {
      int64_t x = round * 100 + r;
      QCAL_RETURN_IF_ERROR(c.AllReduceSum(&x, 1));
      EXPECT_EQ(x, round * 100 * n + n * (n - 1) / 2);
      QCAL_RETURN_IF_ERROR(c.Barrier());
    }
    // Broadcast from the last rank.
    char msg[6] = {0};
    if (r == n - 1) std::memcpy(msg, "hello", 6);
    QCAL_RETURN_IF_ERROR(c.Broadcast(msg, 6, n - 1));
    bcast[r] = msg;
    // Gather of different sizes (rank r sends r+1 bytes of 'a'+r; rank 1 sends nothing).
    std::string mine(r == 1 ? 0 : r + 1, static_cast<char>('a' + r));
    std::vector<char> out = {'x'};
    QCAL_RETURN_IF_ERROR(c.Gather(mine.data(), mine.size(), 0, &out));
    gathered[r] = out;
    // AllGather of the same parts: every rank gets them all, with the sizes.
    std::vector<char> all = {'x'};
    std::vector<size_t> sizes;
    QCAL_RETURN_IF_ERROR(AllGather(c, mine.data(), mine.size(), &all, &sizes));
    all_gathered[r] = all;
    all_sizes[r] = sizes;
    return absl::OkStatus();
  });
  std::string expect_gather;
  for (int r = 0; r < n; ++r) expect_gather += std::string(r == 1 ? 0 : r + 1, 'a' + r);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(isums[r][0], n * (n + 1) / 2);
    EXPECT_EQ(isums[r][1], -(int64_t{1} << 40) * n * (n + 1) / 2);
    EXPECT_EQ(isums[r][2], int64_t{1} << 60);
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(std::memcmp(&dsums[r][j], &dsums[0][j], sizeof(double)), 0) << "bits differ";
    }
    double expect = 0;
    for (int k = 0; k < n; ++k) expect += 0.1 * (k + 1);  // rank order
    EXPECT_EQ(dsums[r][0], expect);
    EXPECT_EQ(dsums[r][2], -n);
    EXPECT_EQ(bcast[r], "hello");
    EXPECT_EQ(std::string(all_gathered[r].begin(), all_gathered[r].end()), expect_gather)
        << "rank " << r;
    ASSERT_EQ(all_sizes[r].size(), static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) EXPECT_EQ(all_sizes[r][k], k == 1 ? 0u : k + 1u);
    if (r == 0) {
      EXPECT_EQ(std::string(gathered[0].begin(), gathered[0].end()), expect_gather);
    } else {
      EXPECT_EQ(gathered[r], std::vector<char>{'x'}) << "non-root output must be untouched";
    }
  }
}

// AllToAll: rank s sends rank d the message "s>d" repeated (s + d) % 3 times (so some messages
// are empty, and some ranks receive nothing at all from anyone), three rounds back to back.
TEST_P(ThreadCommTest, AllToAllDeliversEveryMessageToItsRank) {
  const int n = GetParam();
  auto message = [](int s, int d, int round) {
    std::string m;
    for (int i = 0; i < (s + d + round) % 3; ++i) m += std::to_string(s) + ">" + std::to_string(d);
    return m;
  };
  std::vector<std::vector<std::string>> got(n, std::vector<std::string>(n * 3));
  auto status = RunRanks(n, [&](Comm& c) -> Status {
    for (int round = 0; round < 3; ++round) {
      std::vector<std::vector<char>> send(n);
      for (int d = 0; d < n; ++d) {
        const std::string m = message(c.rank(), d, round);
        send[d].assign(m.begin(), m.end());
      }
      std::vector<std::vector<char>> recv = {{'x'}};
      QCAL_RETURN_IF_ERROR(AllToAll(c, send, &recv));
      if (static_cast<int>(recv.size()) != n) return absl::InternalError("recv size");
      for (int s = 0; s < n; ++s) {
        got[c.rank()][round * n + s] = std::string(recv[s].begin(), recv[s].end());
      }
    }
    // A send list of the wrong length is refused before any collective.
    std::vector<std::vector<char>> recv;
    if (AllToAll(c, std::vector<std::vector<char>>(n + 1), &recv).ok()) {
      return absl::InternalError("a wrong send list was accepted");
    }
    return absl::OkStatus();
  });
  int nonempty = 0;
  for (int d = 0; d < n; ++d) {
    ASSERT_TRUE(status[d].ok()) << "rank " << d << ": " << status[d];
    for (int round = 0; round < 3; ++round) {
      for (int s = 0; s < n; ++s) {
        EXPECT_EQ(got[d][round * n + s], message(s, d, round))
            << "round " << round << ", " << s << " -> " << d;
        nonempty += !got[d][round * n + s].empty();
      }
    }
  }
  EXPECT_GT(nonempty, 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, ThreadCommTest, ::testing::Values(1, 2, 3, 4));

TEST(ThreadCommErrorsTest, MismatchedCallsFailOnEveryRank) {
  auto status = RunRanks(3, [](Comm& c) -> Status {
    int64_t v[4] = {0, 0, 0, 0};
    // Rank 2 reduces a different count.
    return c.AllReduceSum(v, c.rank() == 2 ? 4 : 3);
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(status[r].ok()) << r;
    EXPECT_NE(status[r].message().find("count"), std::string::npos) << status[r];
  }
}

TEST(ThreadCommErrorsTest, ARankThatLeavesDoesNotHangTheOthers) {
  auto status = RunRanks(3, [](Comm& c) -> Status {
    if (c.rank() == 1) return absl::InternalError("rank 1 failed before the barrier");
    return c.Barrier();
  });
  EXPECT_EQ(status[1].code(), absl::StatusCode::kInternal);
  EXPECT_EQ(status[0].code(), absl::StatusCode::kAborted) << status[0];
  EXPECT_EQ(status[2].code(), absl::StatusCode::kAborted) << status[2];
  EXPECT_NE(status[0].message().find("rank 1 left"), std::string::npos) << status[0];
}

TEST(ThreadCommErrorsTest, BadRootIsAnError) {
  auto comms = MakeThreadComms(1);
  char b = 0;
  EXPECT_EQ(comms[0]->Broadcast(&b, 1, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MakeThreadComms(0).empty());
}

}  // namespace
}  // namespace qcal::comm
