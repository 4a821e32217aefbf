# elastrun_install_python(SUBDIR FILES...): installs Python modules where Debian's /usr/bin/python3
# finds them, decided at install time (the .deb's prefix is only known then): prefix /usr (also
# CPack's staging .../usr) -> lib/python3/dist-packages, Debian's own; any other prefix ->
# lib/python3.X/dist-packages (/usr/local/lib/python3.X/dist-packages is on Debian's path,
# /usr/local/lib/python3/dist-packages is not). FILES may hold generator expressions.
function(elastrun_install_python subdir)
  set(files "")
  foreach(file IN LISTS ARGN)
    string(APPEND files " \"${file}\"")
  endforeach()
  set(version_dir "python${Python_VERSION_MAJOR}.${Python_VERSION_MINOR}")
  if(NOT Python_FOUND)
    set(version_dir python3)
  endif()
  install(CODE "
    if(CMAKE_INSTALL_PREFIX MATCHES \"(^|/)usr$\")
      set(elastrun_python_dir \"\${CMAKE_INSTALL_PREFIX}/lib/python3/dist-packages\")
    else()
      set(elastrun_python_dir \"\${CMAKE_INSTALL_PREFIX}/lib/${version_dir}/dist-packages\")
    endif()
    file(INSTALL ${files} DESTINATION \"\${elastrun_python_dir}/${subdir}\")
  ")
endfunction()
