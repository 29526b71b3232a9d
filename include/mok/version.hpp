#pragma once
#define MOK_VERSION_MAJOR 0
#define MOK_VERSION_MINOR 1
#define MOK_VERSION_PATCH 0
namespace mok {
inline constexpr const char* kVersion = "0.1.0";
}
