#include "elastrun/ckpt/mpi_comm.hpp"

#include <fmt/format.h>

#include <limits>

#include "elastrun/ckpt/errors.hpp"

namespace elastrun::ckpt {

namespace {
void check_mpi(int status, const char* what) {
  if (status != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(status, text, &length);
    throw CheckpointError(fmt::format("{} failed: {}", what, std::string_view(text, length)));
  }
}
}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

std::vector<std::string> MpiCommunicator::allgather(std::string_view mine) {
  const int my_length = static_cast<int>(mine.size());
  std::vector<int> lengths(static_cast<std::size_t>(size_));
  check_mpi(MPI_Allgather(&my_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm_),
            "MPI_Allgather of manifest lengths");
  std::vector<int> displacements(lengths.size());
  int total = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    displacements[i] = total;
    total += lengths[i];
  }
  std::string gathered(static_cast<std::size_t>(total), '\0');
  check_mpi(MPI_Allgatherv(mine.data(), my_length, MPI_CHAR, gathered.data(), lengths.data(), displacements.data(),
                           MPI_CHAR, comm_),
            "MPI_Allgatherv of manifests");
  std::vector<std::string> result;
  result.reserve(lengths.size());
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    result.push_back(gathered.substr(static_cast<std::size_t>(displacements[i]), static_cast<std::size_t>(lengths[i])));
  }
  return result;
}

std::vector<std::string> MpiCommunicator::gather(std::string_view mine) {
  const int my_length = static_cast<int>(mine.size());
  std::vector<int> lengths(rank_ == 0 ? static_cast<std::size_t>(size_) : 0);
  check_mpi(MPI_Gather(&my_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, comm_), "MPI_Gather of message lengths");
  std::vector<int> displacements(lengths.size());
  long long total = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    displacements[i] = static_cast<int>(total);
    total += lengths[i];
  }
  if (total > std::numeric_limits<int>::max()) {
    throw CheckpointError("MPI_Gatherv: the ranks' messages exceed 2 GiB");
  }
  std::string gathered(static_cast<std::size_t>(total), '\0');
  check_mpi(MPI_Gatherv(mine.data(), my_length, MPI_CHAR, gathered.data(), lengths.data(), displacements.data(),
                        MPI_CHAR, 0, comm_),
            "MPI_Gatherv of messages");
  std::vector<std::string> result;
  result.reserve(lengths.size());
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    result.push_back(gathered.substr(static_cast<std::size_t>(displacements[i]), static_cast<std::size_t>(lengths[i])));
  }
  return result;
}

std::string MpiCommunicator::broadcast(std::string_view mine) {
  int length = rank_ == 0 ? static_cast<int>(mine.size()) : 0;
  check_mpi(MPI_Bcast(&length, 1, MPI_INT, 0, comm_), "MPI_Bcast of message length");
  std::string value = rank_ == 0 ? std::string(mine) : std::string(static_cast<std::size_t>(length), '\0');
  check_mpi(MPI_Bcast(value.data(), length, MPI_CHAR, 0, comm_), "MPI_Bcast of message");
  return value;
}

}  // namespace elastrun::ckpt
