# Finds mok's dependencies; never vendors them. Each missing one stops configure with
# a message saying how to get it (scripts/setup.sh installs all of them).
set(_mok_deps_dir "${PROJECT_SOURCE_DIR}/.deps/python")
find_package(Python3 COMPONENTS Interpreter)

# --- CUDA toolkit: cudart, cuBLAS, CUB (CCCL) --------------------------------------
find_package(CUDAToolkit 13.0)
if(NOT CUDAToolkit_FOUND)
  message(FATAL_ERROR "mok: CUDA toolkit >= 13.0 not found. Install CUDA 13 (nvcc, cuBLAS, CCCL) "
                      "and put its bin/ on PATH, or set -DCUDAToolkit_ROOT=/usr/local/cuda.")
endif()
if(NOT EXISTS "${CUDAToolkit_INCLUDE_DIRS}/cub/cub.cuh" AND NOT EXISTS "${CUDAToolkit_INCLUDE_DIRS}/cccl/cub/cub.cuh")
  message(FATAL_ERROR "mok: CUB headers not found under ${CUDAToolkit_INCLUDE_DIRS}; install the full CUDA toolkit (CCCL).")
endif()

# --- NCCL >= 2.28 with the device API (nccl_device.h) -------------------------------
set(_nccl_hints ${MOK_NCCL_DIR} ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR}
                "${_mok_deps_dir}/nvidia/nccl")
find_path(MOK_NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
find_library(MOK_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64)
if(NOT MOK_NCCL_INCLUDE_DIR OR NOT MOK_NCCL_LIBRARY OR NOT EXISTS "${MOK_NCCL_INCLUDE_DIR}/nccl_device.h")
  message(FATAL_ERROR "mok: NCCL >= 2.28 with the device API (nccl.h, nccl_device.h, libnccl) not found. "
                      "Install it with `python3 -m pip install --target .deps/python nvidia-nccl-cu13==2.28.9` "
                      "(scripts/setup.sh does), or pass -DMOK_NCCL_DIR=/path/to/nccl.")
endif()
file(STRINGS "${MOK_NCCL_INCLUDE_DIR}/nccl.h" _nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*" "\\1" MOK_NCCL_MAJOR "${_nccl_ver}")
string(REGEX REPLACE ".*NCCL_MINOR ([0-9]+).*" "\\1" MOK_NCCL_MINOR "${_nccl_ver}")
string(REGEX REPLACE ".*NCCL_PATCH ([0-9]+).*" "\\1" MOK_NCCL_PATCH "${_nccl_ver}")
if(MOK_NCCL_MAJOR LESS 2 OR (MOK_NCCL_MAJOR EQUAL 2 AND MOK_NCCL_MINOR LESS 28))
  message(FATAL_ERROR "mok: NCCL ${MOK_NCCL_MAJOR}.${MOK_NCCL_MINOR} at ${MOK_NCCL_INCLUDE_DIR} is too old; "
                      "the device API needs >= 2.28 (pip install nvidia-nccl-cu13==2.28.9).")
endif()
add_library(mok::nccl UNKNOWN IMPORTED)
set_target_properties(mok::nccl PROPERTIES IMPORTED_LOCATION "${MOK_NCCL_LIBRARY}"
                      INTERFACE_INCLUDE_DIRECTORIES "${MOK_NCCL_INCLUDE_DIR}")
message(STATUS "mok: NCCL ${MOK_NCCL_MAJOR}.${MOK_NCCL_MINOR}.${MOK_NCCL_PATCH}: ${MOK_NCCL_LIBRARY}")

# --- CuTe / CUTLASS headers, pinned to the nvidia-cutlass 4.2.0 PyPI package ---------
set(MOK_CUTLASS_PIN "4.2.0")
if(NOT MOK_CUTLASS_DIR)
  if(EXISTS "${_mok_deps_dir}/cutlass_library/source/include/cute/tensor.hpp")
    set(MOK_CUTLASS_DIR "${_mok_deps_dir}/cutlass_library/source/include")
  elseif(Python3_Interpreter_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c
                    "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
                    OUTPUT_VARIABLE _cutlass_py OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_cutlass_py AND EXISTS "${_cutlass_py}/cute/tensor.hpp")
      set(MOK_CUTLASS_DIR "${_cutlass_py}")
    endif()
  endif()
endif()
if(NOT MOK_CUTLASS_DIR OR NOT EXISTS "${MOK_CUTLASS_DIR}/cute/tensor.hpp")
  message(FATAL_ERROR "mok: CuTe/CUTLASS ${MOK_CUTLASS_PIN} headers not found. Install the pinned package with "
                      "`python3 -m pip install --target .deps/python nvidia-cutlass==4.2.0.0` (scripts/setup.sh does), "
                      "or pass -DMOK_CUTLASS_DIR=/path/to/cutlass/include.")
endif()
file(STRINGS "${MOK_CUTLASS_DIR}/cutlass/version.h" _cutlass_ver REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*" "\\1" _cl_major "${_cutlass_ver}")
string(REGEX REPLACE ".*CUTLASS_MINOR ([0-9]+).*" "\\1" _cl_minor "${_cutlass_ver}")
string(REGEX REPLACE ".*CUTLASS_PATCH ([0-9]+).*" "\\1" _cl_patch "${_cutlass_ver}")
if(NOT "${_cl_major}.${_cl_minor}.${_cl_patch}" STREQUAL MOK_CUTLASS_PIN)
  message(FATAL_ERROR "mok: CUTLASS at ${MOK_CUTLASS_DIR} is ${_cl_major}.${_cl_minor}.${_cl_patch}; "
                      "mok is pinned to ${MOK_CUTLASS_PIN} (pip install nvidia-cutlass==4.2.0.0).")
endif()
add_library(mok::cute INTERFACE IMPORTED)
set_target_properties(mok::cute PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${MOK_CUTLASS_DIR}")
message(STATUS "mok: CUTLASS ${MOK_CUTLASS_PIN}: ${MOK_CUTLASS_DIR}")

# --- GoogleTest ----------------------------------------------------------------------
if(MOK_BUILD_TESTS)
  find_package(GTest)
  if(NOT GTest_FOUND)
    message(FATAL_ERROR "mok: GoogleTest not found. Install it with `apt-get install libgtest-dev` "
                        "(scripts/setup.sh does), or configure with -DMOK_BUILD_TESTS=OFF.")
  endif()
  include(GoogleTest)
endif()

find_package(Threads REQUIRED)
