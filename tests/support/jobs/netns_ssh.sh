#!/bin/sh
# A stand-in for ssh in the two-host tests: `netns_ssh.sh HOST LINE...` runs LINE "on" HOST by
# entering the network namespace that HOST's address lives in, as `ip netns exec NS sh -c LINE`.
# The address -> namespace map comes from NETNS_SSH_MAP, "ADDR=NS ADDR=NS ..." (space separated).
# Like ssh, the remaining arguments are joined with spaces into one shell line.
set -eu
if [ "$#" -lt 2 ]; then
    echo "usage: $0 HOST LINE..." >&2
    exit 255
fi
host=$1
shift
line=$*
ns=
for pair in ${NETNS_SSH_MAP:-}; do
    case $pair in
        "$host="*) ns=${pair#*=} ;;
    esac
done
if [ -z "$ns" ]; then
    echo "netns_ssh.sh: no namespace for host '$host' (NETNS_SSH_MAP='${NETNS_SSH_MAP:-}')" >&2
    exit 255
fi
exec ip netns exec "$ns" sh -c "$line"
