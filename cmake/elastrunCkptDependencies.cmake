# The private link dependencies of the static library elastrun::ckpt that come from pkg-config
# (HDF5 built for Open MPI, xxhash), as imported targets named for elastrun:
# PkgConfig::elastrun_hdf5 and PkgConfig::elastrun_xxhash, so they never collide with a project's
# own PkgConfig::HDF5 (serial HDF5, say). The build links them; the installed package config
# (elastrunConfig.cmake) includes this file, so that the $<LINK_ONLY:...> entries of the exported
# static library name targets that exist in the user's project too.
#   in:  elastrun_ckpt_dependencies_global  TRUE: GLOBAL imported targets (the build)
#   out: elastrun_ckpt_dependencies_missing what was not found (empty: all found)
set(elastrun_ckpt_dependencies_missing "")
if(NOT PKG_CONFIG_FOUND)
  find_package(PkgConfig QUIET)
endif()
if(NOT PKG_CONFIG_FOUND)
  set(elastrun_ckpt_dependencies_missing pkg-config)
  return()
endif()
set(_elastrun_global "")
if(elastrun_ckpt_dependencies_global)
  set(_elastrun_global GLOBAL)
endif()
if(NOT TARGET PkgConfig::elastrun_hdf5)
  pkg_check_modules(elastrun_hdf5 QUIET IMPORTED_TARGET ${_elastrun_global} hdf5-openmpi)
endif()
if(NOT TARGET PkgConfig::elastrun_hdf5)
  list(APPEND elastrun_ckpt_dependencies_missing hdf5-openmpi)
endif()
if(NOT TARGET PkgConfig::elastrun_xxhash)
  pkg_check_modules(elastrun_xxhash QUIET IMPORTED_TARGET ${_elastrun_global} libxxhash)
endif()
if(NOT TARGET PkgConfig::elastrun_xxhash)
  list(APPEND elastrun_ckpt_dependencies_missing libxxhash)
endif()
unset(_elastrun_global)
