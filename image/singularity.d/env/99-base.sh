#!/bin/sh
# Last of the image's environment scripts: libraries that `apptainer exec --nv` binds into
# /.singularity.d/libs (the host's NVIDIA driver) come first on the library path.
if [ -d /.singularity.d/libs ]; then
    case ":${LD_LIBRARY_PATH:-}:" in
        *:/.singularity.d/libs:*) ;;
        *) LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/.singularity.d/libs" ;;
    esac
    export LD_LIBRARY_PATH
fi
