#!/bin/sh
# First of the image's environment scripts (sourced in name order by the actions and by Apptainer).
# A PATH for the image when the host passed none.
if [ -z "${PATH:-}" ]; then
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    export PATH
fi
