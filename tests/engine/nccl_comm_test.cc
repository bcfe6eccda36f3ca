// NcclComm on a world of one (MPI_COMM_SELF): NCCL refuses two ranks on one device, and CI has at
// most one. Skips visibly without a CUDA device (label gpu).
#include "engine/comm/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda_status.h"

namespace qcal::comm {
namespace {

class NcclCommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  }
};

TEST_F(NcclCommTest, CollectivesOnDeviceBuffers) {
  auto made = MakeNcclComm(MPI_COMM_SELF, 0);
  ASSERT_TRUE(made.ok()) << made.status();
  Comm& c = **made;
  EXPECT_EQ(c.name(), "nccl");
  EXPECT_EQ(c.size(), 1);
  const std::vector<int64_t> host = {1, -(int64_t{1} << 40), int64_t{1} << 60};
  int64_t* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, host.size() * sizeof(int64_t)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), host.size() * sizeof(int64_t), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_TRUE(c.AllReduceSum(dev, host.size()).ok());
  std::vector<int64_t> back(host.size());
  ASSERT_EQ(cudaMemcpy(back.data(), dev, host.size() * sizeof(int64_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(back, host);
  ASSERT_TRUE(c.Broadcast(dev, 8, 0).ok());
  std::vector<char> out;
  ASSERT_TRUE(c.Gather(dev, 16, 0, &out).ok());
  ASSERT_EQ(out.size(), 16u);
  EXPECT_EQ(std::memcmp(out.data(), host.data(), 16), 0);
  ASSERT_TRUE(c.Barrier().ok());
  EXPECT_EQ(c.Broadcast(dev, 8, 1).code(), absl::StatusCode::kInvalidArgument);
  cudaFree(dev);
}

}  // namespace
}  // namespace qcal::comm

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  MPI_Finalize();
  return rc;
}
