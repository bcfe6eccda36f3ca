# Common compile settings for every qcal target.
function(qcal_target_defaults target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
endfunction()

# qcal_add_library(name SOURCES ... DEPS ... [PRIVATE_DEPS ...])
function(qcal_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  qcal_target_defaults(${name})
endfunction()

# qcal_add_test(name SOURCES ... DEPS ... [LABELS ...] [TIMEOUT s] [DISCOVER])
# DISCOVER registers every GoogleTest case as its own ctest test (so ctest -j runs them in
# parallel); use it for suites of long, independent cases.
# Builds a GoogleTest binary and registers it with ctest. Tests run from the build directory and
# find the shared data through the QCAL_SHARED_DIR environment variable.
# The test executable and the environment every qcal test runs with (shared by qcal_add_test and
# qcal_add_mpi_test).
if(NOT QCAL_SHARED_DIR)
  message(FATAL_ERROR "QCAL_SHARED_DIR must be set before include(QcalHelpers)")
endif()
set(QCAL_TEST_ENV
    "QCAL_SHARED_DIR=${QCAL_SHARED_DIR};QCAL_BUILD_DIR=${PROJECT_BINARY_DIR};QCAL_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
function(_qcal_test_executable name sources deps)
  add_executable(${name} ${sources})
  target_link_libraries(${name} PRIVATE ${deps} GTest::gtest)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  # Defaults so a test binary also runs outside ctest; the environment overrides them.
  target_compile_definitions(${name} PRIVATE
    QCAL_DEFAULT_SHARED_DIR="${QCAL_SHARED_DIR}" QCAL_DEFAULT_BUILD_DIR="${PROJECT_BINARY_DIR}")
  qcal_target_defaults(${name})
endfunction()

function(qcal_add_test name)
  cmake_parse_arguments(ARG "DISCOVER" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  _qcal_test_executable(${name} "${ARG_SOURCES}" "${ARG_DEPS};GTest::gtest_main")
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 600)
  endif()
  set(env "${QCAL_TEST_ENV}")
  if(ARG_DISCOVER)
    include(GoogleTest)
    gtest_discover_tests(${name} TEST_PREFIX "${name}." DISCOVERY_TIMEOUT 60
      PROPERTIES TIMEOUT ${ARG_TIMEOUT} ENVIRONMENT "${env}" LABELS "${ARG_LABELS}")
    return()
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} ENVIRONMENT "${env}")
  if(ARG_LABELS)
    set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}")
  endif()
endfunction()

# qcal_add_mpi_test(name NP SOURCES ... DEPS ... [LABELS ...] [TIMEOUT s]): a GoogleTest binary
# with its own main (it calls MPI_Init), run by ctest as `mpirun -np NP --oversubscribe`, label
# mpi. The root-run and oversubscription variables Open MPI needs are set for it.
function(qcal_add_mpi_test name np)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  _qcal_test_executable(${name} "${ARG_SOURCES}" "${ARG_DEPS};MPI::MPI_CXX")
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 600)
  endif()
  add_test(NAME ${name}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe
                   ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${name}> ${MPIEXEC_POSTFLAGS})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "mpi;${ARG_LABELS}"
    ENVIRONMENT "${QCAL_TEST_ENV};OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
endfunction()
