# FindSlurm: libslurm and its headers (Debian ships no pkg-config file for libslurm).
# Provides Slurm::slurm (library + headers), Slurm::headers (headers only, for the SPANK plugin,
# which must take its symbols from the Slurm process that loads it) and SLURM_PLUGIN_DIR.
find_path(SLURM_INCLUDE_DIR slurm/slurm.h)
find_library(SLURM_LIBRARY slurm)
if(SLURM_INCLUDE_DIR AND EXISTS "${SLURM_INCLUDE_DIR}/slurm/slurm_version.h")
  file(STRINGS "${SLURM_INCLUDE_DIR}/slurm/slurm_version.h" _slurm_ver REGEX "^#define SLURM_VERSION_STRING")
  string(REGEX REPLACE ".*\"([0-9.]+)\".*" "\\1" SLURM_VERSION "${_slurm_ver}")
endif()
# Plugin dir: where the installed plugins live (e.g. .../slurm-wlm); found from a known plugin.
# The plugins live next to libslurm (Debian: /usr/lib/<arch>/slurm-wlm).
get_filename_component(_slurm_libdir "${SLURM_LIBRARY}" DIRECTORY)
find_path(SLURM_PLUGIN_DIR NAMES proctrack_linuxproc.so auth_munge.so
          HINTS "${_slurm_libdir}" PATH_SUFFIXES slurm-wlm slurm NO_DEFAULT_PATH)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Slurm REQUIRED_VARS SLURM_LIBRARY SLURM_INCLUDE_DIR
                                  VERSION_VAR SLURM_VERSION)
if(Slurm_FOUND AND NOT TARGET Slurm::slurm)
  add_library(Slurm::headers INTERFACE IMPORTED)
  set_target_properties(Slurm::headers PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${SLURM_INCLUDE_DIR}")
  add_library(Slurm::slurm UNKNOWN IMPORTED)
  set_target_properties(Slurm::slurm PROPERTIES IMPORTED_LOCATION "${SLURM_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${SLURM_INCLUDE_DIR}")
endif()
