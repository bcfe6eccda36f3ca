# Common compile settings for every qcal target.
function(qcal_target_defaults target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
endfunction()

# Records a target for the layering check (qcal_layering_check): the files it owns (its sources,
# the header beside each source, and HEADERS) and the qcal targets it links.
function(_qcal_layering_record name sources headers deps)
  set(files)
  foreach(f ${sources} ${headers})
    get_filename_component(abs "${f}" ABSOLUTE)
    list(APPEND files "${abs}")
    if(abs MATCHES "\\.(cc|cu)$")
      string(REGEX REPLACE "\\.(cc|cu)$" ".h" h "${abs}")
      if(EXISTS "${h}")
        list(APPEND files "${h}")
      endif()
      string(REGEX REPLACE "\\.(cc|cu)$" ".cuh" h "${abs}")
      if(EXISTS "${h}")
        list(APPEND files "${h}")
      endif()
    endif()
  endforeach()
  set_property(GLOBAL APPEND PROPERTY QCAL_LAYER_TARGETS ${name})
  set_property(GLOBAL PROPERTY QCAL_LAYER_FILES_${name} "${files}")
  set_property(GLOBAL PROPERTY QCAL_LAYER_DEPS_${name} "${deps}")
endfunction()

# qcal_add_library(name SOURCES ... [HEADERS ...] DEPS ... [PRIVATE_DEPS ...])
# One static library per module. HEADERS lists header-only files the module owns (a header
# beside a source is owned with it).
function(qcal_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;HEADERS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  qcal_target_defaults(${name})
  _qcal_layering_record(${name} "${ARG_SOURCES}" "${ARG_HEADERS}" "${ARG_DEPS};${ARG_PRIVATE_DEPS}")
endfunction()

# qcal_add_executable(name SOURCES ... DEPS ...): a program of a module, checked like a library.
function(qcal_add_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  qcal_target_defaults(${name})
  _qcal_layering_record(${name} "${ARG_SOURCES}" "" "${ARG_DEPS}")
endfunction()

# Registers generated headers ("proto/qcal.pb.h") as owned by `target`.
function(qcal_layering_generated target)
  set_property(GLOBAL APPEND PROPERTY QCAL_LAYER_GENERATED_${target} ${ARGN})
endfunction()

# The layering check: writes build/layering.json (every module, its files, the modules it links)
# and a target every module depends on, which runs scripts/check-layering.py: an #include of a
# header owned by a module the includer does not link (directly or not), a header no module
# owns, or a cycle between modules fails the build.
function(qcal_layering_check)
  get_property(targets GLOBAL PROPERTY QCAL_LAYER_TARGETS)
  set(json "{")
  set(all_files)
  set(sep "")
  foreach(t ${targets})
    get_property(files GLOBAL PROPERTY QCAL_LAYER_FILES_${t})
    get_property(deps GLOBAL PROPERTY QCAL_LAYER_DEPS_${t})
    get_property(gen GLOBAL PROPERTY QCAL_LAYER_GENERATED_${t})
    set(qdeps)
    foreach(d ${deps})
      if(d IN_LIST targets)
        list(APPEND qdeps "\"${d}\"")
      endif()
    endforeach()
    set(qfiles)
    foreach(f ${files})
      file(RELATIVE_PATH rel "${PROJECT_SOURCE_DIR}" "${f}")
      list(APPEND qfiles "\"${rel}\"")
      list(APPEND all_files "${f}")
    endforeach()
    set(qgen)
    foreach(g ${gen})
      list(APPEND qgen "\"${g}\"")
    endforeach()
    list(JOIN qdeps "," qdeps)
    list(JOIN qfiles "," qfiles)
    list(JOIN qgen "," qgen)
    string(APPEND json "${sep}\n \"${t}\": {\"files\": [${qfiles}], \"generated\": [${qgen}], \"deps\": [${qdeps}]}")
    set(sep ",")
  endforeach()
  string(APPEND json "\n}\n")
  file(WRITE "${PROJECT_BINARY_DIR}/layering.json" "${json}")
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
  add_custom_command(
    OUTPUT "${PROJECT_BINARY_DIR}/layering.ok"
    COMMAND ${Python3_EXECUTABLE} "${PROJECT_SOURCE_DIR}/scripts/check-layering.py"
            "${PROJECT_SOURCE_DIR}" "${PROJECT_BINARY_DIR}/layering.json"
    COMMAND ${CMAKE_COMMAND} -E touch "${PROJECT_BINARY_DIR}/layering.ok"
    DEPENDS ${all_files} "${PROJECT_SOURCE_DIR}/scripts/check-layering.py"
            "${PROJECT_BINARY_DIR}/layering.json"
    COMMENT "Checking module layering (scripts/check-layering.py)")
  add_custom_target(qcal_layering ALL DEPENDS "${PROJECT_BINARY_DIR}/layering.ok")
  foreach(t ${targets})
    add_dependencies(${t} qcal_layering)
  endforeach()
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

# tests/test_main.cc: GoogleTest's main after the BLAS kernel choice qcal's programs make.
function(_qcal_test_main)
  if(NOT TARGET qcal_test_main)
    add_library(qcal_test_main STATIC ${PROJECT_SOURCE_DIR}/tests/test_main.cc)
    target_link_libraries(qcal_test_main PUBLIC GTest::gtest qcal_formats)
    target_include_directories(qcal_test_main PRIVATE ${PROJECT_SOURCE_DIR})
    qcal_target_defaults(qcal_test_main)
  endif()
endfunction()

function(qcal_add_test name)
  cmake_parse_arguments(ARG "DISCOVER" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  _qcal_test_main()
  _qcal_test_executable(${name} "${ARG_SOURCES}" "${ARG_DEPS};qcal_test_main")
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 600)
  endif()
  set(env "${QCAL_TEST_ENV}")
  if(ARG_DISCOVER)
    include(GoogleTest)
    # gtest_discover_tests passes only the first variable of a list-valued ENVIRONMENT on to
    # the discovered tests (QCAL_SHARED_DIR): the others reach them as compiled-in defaults.
    target_compile_definitions(${name} PRIVATE QCAL_DEFAULT_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
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
