// MpiComm under mpirun (ctest runs it with -np 2; label mpi). Also runs as a singleton (world of
// one) when started directly.
#include "engine/comm/mpi_comm.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <string>

namespace qcal::comm {
namespace {

TEST(MpiCommTest, CollectivesMatchTheirDefinition) {
  auto made = MakeMpiComm(MPI_COMM_WORLD);
  ASSERT_TRUE(made.ok()) << made.status();
  Comm& c = **made;
  const int n = c.size(), r = c.rank();
  std::printf("[ mpi      ] rank %d of %d\n", r, n);
  EXPECT_EQ(c.name(), "mpi");

  std::vector<int64_t> iv = {r + 1, -(int64_t{1} << 40) * (r + 1), r == 0 ? int64_t{1} << 60 : 0};
  ASSERT_TRUE(c.AllReduceSum(iv.data(), iv.size()).ok());
  EXPECT_EQ(iv[0], n * (n + 1) / 2);
  EXPECT_EQ(iv[1], -(int64_t{1} << 40) * n * (n + 1) / 2);
  EXPECT_EQ(iv[2], int64_t{1} << 60);

  double d[2] = {0.5 * (r + 1), -1.0};
  ASSERT_TRUE(c.AllReduceSum(d, 2).ok());
  EXPECT_EQ(d[0], 0.25 * n * (n + 1));
  EXPECT_EQ(d[1], -n);

  char msg[6] = {0};
  if (r == n - 1) std::memcpy(msg, "hello", 6);
  ASSERT_TRUE(c.Broadcast(msg, 6, n - 1).ok());
  EXPECT_STREQ(msg, "hello");

  std::string mine(r == 1 ? 0 : r + 1, static_cast<char>('a' + r));
  std::vector<char> out = {'x'};
  ASSERT_TRUE(c.Gather(mine.data(), mine.size(), 0, &out).ok());
  if (r == 0) {
    std::string expect;
    for (int k = 0; k < n; ++k) expect += std::string(k == 1 ? 0 : k + 1, 'a' + k);
    EXPECT_EQ(std::string(out.begin(), out.end()), expect);
  } else {
    EXPECT_EQ(out, std::vector<char>{'x'});
  }
  // AllGather (built on AllReduceSum and Broadcast): every rank gets every part, in rank order.
  std::vector<char> all = {'x'};
  ASSERT_TRUE(AllGather(c, mine.data(), mine.size(), &all).ok());
  {
    std::string expect;
    for (int k = 0; k < n; ++k) expect += std::string(k == 1 ? 0 : k + 1, 'a' + k);
    EXPECT_EQ(std::string(all.begin(), all.end()), expect);
  }
  ASSERT_TRUE(c.Barrier().ok());
  // A bad root is refused locally, without a collective.
  EXPECT_EQ(c.Broadcast(msg, 1, n).code(), absl::StatusCode::kInvalidArgument);
}

TEST(MpiCommTest, MpiErrorsBecomeStatus) {
  const Status s = MpiStatus(MPI_ERR_COUNT, "MPI_Send(...)", "x.cc", 7);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("MPI_Send(...)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("x.cc:7"), std::string::npos) << s;
}

}  // namespace
}  // namespace qcal::comm

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    // One report: the other ranks' failures still fail the run through the exit code.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
