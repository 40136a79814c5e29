// One process per GPU, for the DCP tests on GPUs and the DCP benchmark (bench/cuda_dcp_bench.cpp).
// A process that has initialized CUDA cannot fork children that use it, so the parent never calls
// CUDA: run_nccl_ranks forks N children; child r makes GPU r current, joins an NCCL group (rank 0
// makes the id and passes it down pipes), runs body(rank, comm) and exits 0 -- or 1 after an
// exception (printed) or when failed() says so (the tests pass GoogleTest's HasFailure). Results come back through SharedBytes, mapped before the fork.
// NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the shared GPU machines require.
#pragma once

#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

#include "pagedattn/dcp_nccl.h"

namespace pagedattn::nccl_ranks {

// Bytes shared by the parent and every child (MAP_SHARED | MAP_ANONYMOUS), zero-filled.
class SharedBytes {
 public:
  explicit SharedBytes(size_t bytes) : bytes_(std::max<size_t>(bytes, 1)) {
    data_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (data_ == MAP_FAILED) std::abort();
  }
  ~SharedBytes() { munmap(data_, bytes_); }
  SharedBytes(const SharedBytes&) = delete;
  SharedBytes& operator=(const SharedBytes&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t size() const { return bytes_; }

 private:
  size_t bytes_;
  void* data_;
};

// Runs f in a child process; returns its exit code (-1 when it died of a signal).
inline int in_child(const std::function<int()>& f) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = f();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    std::fflush(nullptr);
    _exit(rc);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// GPUs visible, counted in a child (the parent stays CUDA-free).
inline int gpu_count() {
  SharedBytes count(sizeof(int));
  const int rc = in_child([&] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    *count.as<int>() = n;
    return 0;
  });
  return rc == 0 ? *count.as<int>() : 0;
}

// Forks `world` ranks (see above); returns each child's exit code (0 = passed).
inline std::vector<int> run_nccl_ranks(int world, const std::function<void(int, DcpCommunicator&)>& body,
                                       const std::function<bool()>& failed = {}) {
  std::vector<int> fds(2 * static_cast<size_t>(world), -1);  // pipe r: rank 0 -> rank r
  for (int r = 1; r < world; ++r) {
    if (pipe(&fds[2 * static_cast<size_t>(r)]) != 0) std::abort();
  }
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid != 0) {
      pids.push_back(pid);
      continue;
    }
    // Keep only this rank's ends, so that a rank 0 that dies makes the others' read fail at once.
    for (int o = 1; o < world; ++o) {
      const auto i = 2 * static_cast<size_t>(o);
      if (r != 0) close(fds[i + 1]);
      if (o != r) close(fds[i]);
    }
    int rc = 1;
    try {
      setenv("NCCL_NVLS_ENABLE", "0", 1);
      if (cudaSetDevice(r) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
      NcclUniqueId id;
      if (r == 0) {
        id = nccl_unique_id();
        for (int o = 1; o < world; ++o) {
          if (write(fds[2 * static_cast<size_t>(o) + 1], id.bytes.data(), id.bytes.size()) !=
              static_cast<ssize_t>(id.bytes.size())) {
            throw std::runtime_error("writing the NCCL id failed");
          }
        }
      } else if (read(fds[2 * static_cast<size_t>(r)], id.bytes.data(), id.bytes.size()) !=
                 static_cast<ssize_t>(id.bytes.size())) {
        throw std::runtime_error("reading the NCCL id failed");
      }
      {
        const std::unique_ptr<DcpCommunicator> comm = make_nccl_dcp_communicator(id, world, r);
        body(r, *comm);
        if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("a kernel failed");
      }
      rc = failed && failed() ? 1 : 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", r, e.what());
    }
    std::fflush(nullptr);
    _exit(rc);
  }
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  return codes;
}

}  // namespace pagedattn::nccl_ranks
