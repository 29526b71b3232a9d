# Helpers that keep the per-folder CMakeLists short: every layer is one static library
# made of the sources in its folder; every tests/<suite>/test_*.{cpp,cu} is one test binary.

# CUDA flags every mok CUDA target uses.
function(mok_cuda_options target)
  separate_arguments(_gencode UNIX_COMMAND "${MOK_CUDA_GENCODE}")
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:${_gencode} --expt-relaxed-constexpr -lineinfo
      -Xptxas=--warn-on-spills -Xcompiler=-Wall>)
  set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
endfunction()

# mok_add_layer(<name> [DEPS targets...]) : library mok_<name> from this folder's sources.
function(mok_add_layer name)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  file(GLOB _srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cpp ${CMAKE_CURRENT_SOURCE_DIR}/*.cu)
  if(NOT _srcs)  # a layer with no code yet still links
    add_library(mok_${name} INTERFACE)
    target_include_directories(mok_${name} INTERFACE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
    target_link_libraries(mok_${name} INTERFACE ${ARG_DEPS})
    return()
  endif()
  add_library(mok_${name} STATIC ${_srcs})
  target_include_directories(mok_${name} PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(mok_${name} PUBLIC ${ARG_DEPS})
  mok_cuda_options(mok_${name})
endfunction()

# mok_add_test_suite(<label>) : one executable per test_*.cpp / test_*.cu in this folder,
# each GoogleTest case a CTest test with the label. A test that calls GTEST_SKIP() shows as
# "Skipped" in the CTest summary with its reason in the log.
function(mok_add_test_suite label)
  cmake_parse_arguments(ARG "" "TIMEOUT" "DEPS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 600)
  endif()
  file(GLOB _tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/test_*.cpp ${CMAKE_CURRENT_SOURCE_DIR}/test_*.cu)
  foreach(_src ${_tests})
    get_filename_component(_name ${_src} NAME_WE)
    add_executable(${_name} ${_src})
    target_link_libraries(${_name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main Threads::Threads)
    target_include_directories(${_name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
    mok_cuda_options(${_name})
    gtest_discover_tests(${_name}
      DISCOVERY_MODE PRE_TEST
      PROPERTIES LABELS ${label} TIMEOUT ${ARG_TIMEOUT}
                 SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
  endforeach()
endfunction()

# mok_add_bench(<source> DEPS ...) : one benchmark executable.
function(mok_add_benches)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  file(GLOB _benches CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/bench_*.cpp ${CMAKE_CURRENT_SOURCE_DIR}/bench_*.cu)
  foreach(_src ${_benches})
    get_filename_component(_name ${_src} NAME_WE)
    add_executable(${_name} ${_src})
    target_link_libraries(${_name} PRIVATE ${ARG_DEPS} Threads::Threads)
    target_include_directories(${_name} PRIVATE ${PROJECT_SOURCE_DIR}/bench)
    mok_cuda_options(${_name})
  endforeach()
endfunction()
