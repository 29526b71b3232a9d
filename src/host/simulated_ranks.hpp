// Simulated ranks (comm/simulated_group.hpp): the workspace of one of `ep` ranks that share ONE
// GPU, for running the EP >= 2 paths' tests on a 1-GPU machine (tests/gpu/test_comm_harness.cuh).
// Internal: not part of the public API, and not a performance model of NVLink.
#pragma once

#include <memory>

#include "comm/simulated_group.hpp"
#include "mok/api.hpp"

namespace mok::host {

// Collective over `group` (every rank's thread calls it; a host barrier ends it). The group must
// outlive the workspace; the workspace's destructor is collective over the group as well. The
// caller keeps the rules of comm/simulated_group.hpp (grids that fit together, non-blocking
// streams, nothing device-wide between a rank's launches of one pass).
std::unique_ptr<Workspace> create_simulated_workspace(const LayerShape& shape, const Config& config,
                                                      comm::SimulatedGroup& group, int rank);

}  // namespace mok::host
