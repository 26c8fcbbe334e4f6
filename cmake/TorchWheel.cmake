# LibTorch from the torch Python wheel, as an imported target `dflash::torch`.
# We do not use TorchConfig.cmake: for a CUDA wheel it insists on a matching CUDA toolkit even for a
# CPU-only build. Instead we read the wheel's layout directly.
#   DFLASH_PYTHON     python with torch installed (default: python3)
#   DFLASH_CUDA       AUTO|ON|OFF (AUTO: on when nvcc exists and the wheel's CUDA major matches it)
# Outputs: DFLASH_WITH_CUDA (BOOL), TORCH_WHEEL_DIR, TORCH_WHEEL_CUDA
set(DFLASH_PYTHON "python3" CACHE STRING "python interpreter that has the torch wheel")
execute_process(
  COMMAND ${DFLASH_PYTHON} -c "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.version.cuda or ''); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)"
  OUTPUT_VARIABLE _tw OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _tw_rc)
if(NOT _tw_rc EQUAL 0)
  message(FATAL_ERROR "DFLASH_PYTHON=${DFLASH_PYTHON} cannot import torch; run scripts/test.sh (it installs the venv) or pass -DDFLASH_PYTHON=/path/to/venv/bin/python")
endif()
string(REPLACE "\n" ";" _tw "${_tw}")
list(GET _tw 0 TORCH_WHEEL_DIR)
list(GET _tw 1 TORCH_WHEEL_CUDA)
list(GET _tw 2 _tw_abi)
list(GET _tw 3 TORCH_WHEEL_VERSION)
message(STATUS "torch wheel ${TORCH_WHEEL_VERSION} at ${TORCH_WHEEL_DIR} (CUDA '${TORCH_WHEEL_CUDA}')")

set(DFLASH_WITH_CUDA OFF)
if(NOT DFLASH_CUDA STREQUAL "OFF")
  find_program(_nvcc nvcc HINTS /usr/local/cuda/bin ENV CUDA_HOME PATH_SUFFIXES bin)
  set(_ok OFF)
  if(_nvcc AND TORCH_WHEEL_CUDA)
    execute_process(COMMAND ${_nvcc} --version OUTPUT_VARIABLE _nvv)
    string(REGEX MATCH "release ([0-9]+)\\." _m "${_nvv}")
    set(_nvcc_major "${CMAKE_MATCH_1}")
    string(REGEX MATCH "^[0-9]+" _wheel_major "${TORCH_WHEEL_CUDA}")
    if(_nvcc_major STREQUAL _wheel_major)
      set(_ok ON)
    endif()
  endif()
  if(_ok)
    set(DFLASH_WITH_CUDA ON)
  elseif(DFLASH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DFLASH_CUDA=ON but nvcc (${_nvcc}) and the torch wheel CUDA (${TORCH_WHEEL_CUDA}) do not match")
  else()
    message(STATUS "CUDA disabled: nvcc='${_nvcc}', wheel CUDA='${TORCH_WHEEL_CUDA}'")
  endif()
endif()

# The wheel's include/ also holds an old copy of google/protobuf headers, which would shadow the
# real protobuf's (both are system dirs; gcc searches -isystem dirs before /usr/include). So we
# expose a mirror of include/ without `google/`.
set(_ti ${CMAKE_BINARY_DIR}/torch-include)
file(MAKE_DIRECTORY ${_ti})
file(GLOB _tchildren RELATIVE ${TORCH_WHEEL_DIR}/include ${TORCH_WHEEL_DIR}/include/*)
foreach(c ${_tchildren})
  if(NOT c STREQUAL "google" AND NOT EXISTS ${_ti}/${c})
    file(CREATE_LINK ${TORCH_WHEEL_DIR}/include/${c} ${_ti}/${c} SYMBOLIC)
  endif()
endforeach()
add_library(dflash_torch INTERFACE)
add_library(dflash::torch ALIAS dflash_torch)
target_include_directories(dflash_torch SYSTEM INTERFACE ${_ti} ${TORCH_WHEEL_DIR}/include/torch/csrc/api/include)
# -pthread everywhere LibTorch is used (gtest adds it too), so the shared PCH stays valid.
target_link_libraries(dflash_torch INTERFACE Threads::Threads)
target_compile_options(dflash_torch INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-pthread>)
target_compile_definitions(dflash_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_tw_abi})
set(_tl ${TORCH_WHEEL_DIR}/lib)
if(DFLASH_WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_COMPILER ${_nvcc})
  endif()
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)  # Hopper (H100/H200); override with -DCMAKE_CUDA_ARCHITECTURES
  endif()
  enable_language(CUDA)
  # "-isystem <dir>" as two arguments, not nvcc's default "-isystem=<dir>": ccache rewrites the former
  # relative to CCACHE_BASEDIR, so the CUDA objects are cache hits in a clone in a new folder (CI's).
  set(CMAKE_INCLUDE_SYSTEM_FLAG_CUDA "-isystem ")
  find_package(CUDAToolkit REQUIRED)
  # NCCL: the wheel's nvidia-nccl package first, then NCCL_ROOT, then the toolkit.
  get_filename_component(_site ${TORCH_WHEEL_DIR} DIRECTORY)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT}/include ${_site}/nvidia/nccl/include ${_site}/nvidia/cu13/include
            ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
  if(NOT NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "nccl.h not found (set NCCL_ROOT)")
  endif()
  target_include_directories(dflash_torch SYSTEM INTERFACE ${NCCL_INCLUDE_DIR} ${CUDAToolkit_INCLUDE_DIRS})
  target_compile_definitions(dflash_torch INTERFACE DFLASH_WITH_CUDA=1 USE_C10D_NCCL=1 USE_CUDA=1)
  # --no-as-needed: libtorch_cuda registers the CUDA kernels at load time.
  target_link_libraries(dflash_torch INTERFACE
    "-Wl,--no-as-needed" ${_tl}/libtorch_cuda.so ${_tl}/libc10_cuda.so "-Wl,--as-needed"
    ${_tl}/libtorch_cpu.so ${_tl}/libtorch.so ${_tl}/libc10.so CUDA::cudart)
else()
  # CPU-only use of a (possibly CUDA) wheel: libtorch_cpu + libc10 carry every CPU kernel.
  target_link_libraries(dflash_torch INTERFACE ${_tl}/libtorch_cpu.so ${_tl}/libc10.so)
endif()
target_link_options(dflash_torch INTERFACE "-Wl,-rpath,${_tl}")
