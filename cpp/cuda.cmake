# CUDA kernels (Hopper, sm_90a). Included from cpp/CMakeLists.txt when nvcc exists.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

set(FLUX_JAX_CUTLASS_DIR "" CACHE PATH "CUTLASS source root holding include/ and tools/util/include/ (default: the nvidia-cutlass wheel)")
if(NOT FLUX_JAX_CUTLASS_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util, importlib.metadata, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(s.submodule_search_locations[0], 'source') + ';' + importlib.metadata.version('nvidia-cutlass'))"
    OUTPUT_VARIABLE _cutlass_out OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _cutlass_rc)
  if(NOT _cutlass_rc EQUAL 0)
    message(FATAL_ERROR "CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0, "
                        "set FLUX_JAX_CUTLASS_DIR, or build with -DFLUX_JAX_CUDA=OFF")
  endif()
  list(GET _cutlass_out 0 FLUX_JAX_CUTLASS_DIR)
  list(GET _cutlass_out 1 FLUX_JAX_CUTLASS_VERSION)
else()
  set(FLUX_JAX_CUTLASS_VERSION "custom")
endif()
set(FLUX_JAX_CUTLASS_VERSION "${FLUX_JAX_CUTLASS_VERSION}" PARENT_SCOPE)
message(STATUS "flux_jax: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, CUTLASS ${FLUX_JAX_CUTLASS_VERSION} at ${FLUX_JAX_CUTLASS_DIR}")

file(GLOB FLUX_JAX_CUDA_SOURCES CONFIGURE_DEPENDS
  ${CMAKE_CURRENT_SOURCE_DIR}/kernels/cuda/*.cu
  ${CMAKE_CURRENT_SOURCE_DIR}/kernels/cuda/*.cc)
add_library(flux_jax_cuda STATIC ${FLUX_JAX_CUDA_SOURCES})
set_target_properties(flux_jax_cuda PROPERTIES
  CUDA_ARCHITECTURES OFF            # we pass -gencode ourselves (sm_90a)
  CUDA_STANDARD 17
  POSITION_INDEPENDENT_CODE ON)
separate_arguments(_gencode UNIX_COMMAND "${FLUX_JAX_CUDA_GENCODE}")
# -DNDEBUG matters: without it ptxas serializes wgmma (warning C7510).
set(_cuda_flags ${_gencode} -O3 -DNDEBUG --expt-relaxed-constexpr -Xcompiler=-fPIC)
if(FLUX_JAX_PTXAS_VERBOSE)
  list(APPEND _cuda_flags -Xptxas=-v)
endif()
target_compile_options(flux_jax_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${_cuda_flags}>)
target_include_directories(flux_jax_cuda PRIVATE
  ${FLUX_JAX_CUTLASS_DIR}/include ${FLUX_JAX_CUTLASS_DIR}/tools/util/include ${CMAKE_CURRENT_SOURCE_DIR}/kernels/cuda)
target_link_libraries(flux_jax_cuda PUBLIC flux_jax_kernels CUDA::cudart_static)
