#pragma once
// Communicator over an MPI communicator (MPI must be initialised by the caller). If saves run on
// the AsyncSaver thread while the application also uses MPI, initialise with MPI_THREAD_MULTIPLE.
#include <mpi.h>

#include "elastrun/ckpt/comm.hpp"

namespace elastrun::ckpt {

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<std::string> allgather(std::string_view mine) override;
  std::vector<std::string> gather(std::string_view mine) override;
  std::string broadcast(std::string_view mine) override;
  MPI_Comm comm() const { return comm_; }

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace elastrun::ckpt
