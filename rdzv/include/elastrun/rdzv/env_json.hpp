// JSON form of a DetectedEnv (keys documented in docs/environment.md).
#pragma once

#include <nlohmann/json.hpp>

#include "elastrun/rdzv/env.hpp"

namespace elastrun::rdzv {

nlohmann::json to_json(const DetectedEnv& env);

}  // namespace elastrun::rdzv
