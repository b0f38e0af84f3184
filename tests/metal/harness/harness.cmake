# harness.cmake: the Metal CPU harness build (LILY_METAL_EMU=ON, included by the top CMakeLists.txt). Every
# metal/*.metal file goes through rewrite.py into C++ compiled against the shim (include/metal_stdlib); the fiber
# scheduler and the emulated device join lily_core, which then registers a "metal" backend.
if (NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang" OR CMAKE_CXX_COMPILER_VERSION VERSION_LESS 17)
  message(FATAL_ERROR "LILY_METAL_EMU=ON needs clang >= 17 as the C++ compiler (found ${CMAKE_CXX_COMPILER_ID} "
                      "${CMAKE_CXX_COMPILER_VERSION}): apt-get install clang-19, then -DCMAKE_CXX_COMPILER=clang++-19")
endif()
option(LILY_METAL_SANITIZE "Metal harness build with -fsanitize=address,undefined (load with libasan preloaded)" OFF)

set(LILY_HARNESS_DIR ${CMAKE_CURRENT_SOURCE_DIR}/tests/metal/harness)
set(LILY_HARNESS_GEN ${CMAKE_CURRENT_BINARY_DIR}/metal_emu)
set(LILY_REWRITE ${Python_EXECUTABLE} ${LILY_HARNESS_DIR}/rewrite.py)
file(GLOB LILY_METAL_HEADERS CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/metal/*.h)

# The generated C++ of the given .metal files, in gen_dir, plus gen_dir/kernels.cpp (register_all_kernels).
function(lily_metal_rewrite out_var gen_dir)
  set(outs)
  set(stems)
  foreach (src ${ARGN})
    get_filename_component(stem ${src} NAME_WE)
    add_custom_command(OUTPUT ${gen_dir}/${stem}.cpp COMMAND ${LILY_REWRITE} ${src} ${gen_dir}/${stem}.cpp
                       DEPENDS ${src} ${LILY_METAL_HEADERS} ${LILY_HARNESS_DIR}/rewrite.py
                       COMMENT "Metal harness: rewriting ${stem}.metal" VERBATIM)
    list(APPEND outs ${gen_dir}/${stem}.cpp)
    list(APPEND stems ${stem})
  endforeach()
  add_custom_command(OUTPUT ${gen_dir}/kernels.cpp COMMAND ${LILY_REWRITE} --index ${gen_dir}/kernels.cpp ${stems}
                     DEPENDS ${LILY_HARNESS_DIR}/rewrite.py VERBATIM)
  set_source_files_properties(${outs} PROPERTIES
    INCLUDE_DIRECTORIES "${LILY_HARNESS_DIR}/include;${CMAKE_CURRENT_SOURCE_DIR}/metal"
    COMPILE_OPTIONS "-fno-fast-math;-Wno-unknown-attributes;-Wno-unused-parameter")
  set(${out_var} ${outs} ${gen_dir}/kernels.cpp PARENT_SCOPE)
endfunction()

file(GLOB LILY_METAL_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/metal/*.metal)
lily_metal_rewrite(LILY_HARNESS_KERNELS ${LILY_HARNESS_GEN} ${LILY_METAL_SOURCES})
target_sources(lily_core PRIVATE ${LILY_HARNESS_KERNELS} ${LILY_HARNESS_DIR}/scheduler.cpp
               ${LILY_HARNESS_DIR}/emu_device.cpp)
# Hidden: the kernels reach the scheduler by direct calls, not through the PLT of the Python module.
set_property(SOURCE ${LILY_HARNESS_KERNELS} ${LILY_HARNESS_DIR}/scheduler.cpp ${LILY_HARNESS_DIR}/emu_device.cpp
             APPEND PROPERTY COMPILE_OPTIONS -fvisibility=hidden)
target_include_directories(lily_core PRIVATE ${LILY_HARNESS_DIR})
target_compile_definitions(lily_core PUBLIC LILY_HAS_METAL_EMU)

# metal_emu_run: the command-line runner of the harness feature tests, over the deliberately broken kernels.
file(GLOB LILY_HARNESS_BROKEN CONFIGURE_DEPENDS ${LILY_HARNESS_DIR}/broken/*.metal)
lily_metal_rewrite(LILY_HARNESS_BROKEN_KERNELS ${LILY_HARNESS_GEN}/broken ${LILY_HARNESS_BROKEN})
add_executable(metal_emu_run ${LILY_HARNESS_DIR}/driver.cpp ${LILY_HARNESS_DIR}/scheduler.cpp
               ${LILY_HARNESS_BROKEN_KERNELS})
target_include_directories(metal_emu_run PRIVATE ${LILY_HARNESS_DIR})
target_compile_options(metal_emu_run PRIVATE -O2 -fno-fast-math -Wall)


if (LILY_METAL_SANITIZE)
  set(LILY_SAN -fsanitize=address,undefined -fno-sanitize-recover=undefined -fsanitize-address-use-after-return=never
               -fno-omit-frame-pointer -gline-tables-only)
  target_compile_options(lily_core PUBLIC ${LILY_SAN})
  target_link_options(lily_core PUBLIC ${LILY_SAN} -shared-libsan)
  target_compile_options(metal_emu_run PRIVATE ${LILY_SAN})
  target_link_options(metal_emu_run PRIVATE ${LILY_SAN})
endif()
message(STATUS "Lily: Metal CPU harness ON (${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}, "
               "sanitizers ${LILY_METAL_SANITIZE})")
