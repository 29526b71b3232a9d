// Umbrella header of the mok C++ API.
#pragma once
#include "mok/api.hpp"
#include "mok/config.hpp"
#include "mok/error.hpp"
#include "mok/shape.hpp"
#include "mok/version.hpp"
