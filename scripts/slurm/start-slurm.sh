#!/usr/bin/env bash
# Idempotent bring-up of a single-node SLURM 22.05 cluster (Debian bookworm), no systemd:
# try the SLURM path of `esbatch sweep` on one machine (launchers/slurm-local.yaml); the SLURM tests use it.
# munged + mariadbd + slurmdbd + slurmctld + slurmd, all as root-started background daemons.
# Re-running is safe: installs only what is missing, starts only what is not running,
# restarts slurmctld/slurmd only if slurm.conf changed.  Exits 0 once the node is idle.
#
# Env knobs:
#   SLURM_CI_DIR          state/log/pid/db dir          (default /tmp/slurm-dev)
#   SLURM_CI_ACCOUNTING   1 = slurmdbd+mariadb (sacct works), 0 = accounting_storage/none
#   SLURM_CI_CPUS         advertise this many CPUs (may exceed real cores; uses config_overrides)
#   SLURM_CI_MEM_MARGIN   MiB kept back from RealMemory (default 1024)
#   SLURM_CI_DB_PORT      mariadb TCP port on 127.0.0.1   (default 3306)
set -euo pipefail

DIR=${SLURM_CI_DIR:-/tmp/slurm-dev}
ACCT=${SLURM_CI_ACCOUNTING:-1}
MARGIN=${SLURM_CI_MEM_MARGIN:-1024}
DBPORT=${SLURM_CI_DB_PORT:-3306}
DBPASS=slurmci
CONF=/etc/slurm/slurm.conf
DBDCONF=/etc/slurm/slurmdbd.conf
T_START=$(date +%s%N)

log() { local ds=$(( ($(date +%s%N) - T_START) / 100000000 )); printf '[start-slurm %4d.%ds] %s\n' $((ds / 10)) $((ds % 10)) "$*"; }
die() { log "ERROR: $*"; for f in "$DIR"/log/*.log "$DIR"/mysqld/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 30 "$f"; }; done; exit 1; }

# alive PIDFILE COMM -> true if pidfile names a live process with that command name
alive() { local p; [ -s "$1" ] && p=$(cat "$1") && [ -d "/proc/$p" ] && [ "$(cat /proc/$p/comm 2>/dev/null)" = "$2" ]; }
# wait_for SECONDS CMD... -> poll CMD every 0.2 s
wait_for() { local n=$(( $1 * 5 )); shift; for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done; return 1; }

# ---------------------------------------------------------------- 1. packages
PKGS="slurmctld slurmd slurm-client munge"
[ "$ACCT" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
MISSING=""
for p in $PKGS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || MISSING="$MISSING $p"; done
if [ -n "$MISSING" ]; then
  log "installing:$MISSING"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d (docker-style) or missing systemd just make the postinst "start" a no-op
  apt-get install -y -qq --no-install-recommends $MISSING >/dev/null
fi
log "packages ok"
mkdir -p "$DIR"/{ctld,slurmd,log,pids}

# ---------------------------------------------------------------- 2. munge
if [ ! -s /etc/munge/munge.key ]; then
  mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge; chmod 755 /run/munge
if ! (munge -n | unmunge) >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 sh -c 'munge -n | unmunge' || die "munged did not come up"
  cp /run/munge/munged.pid "$DIR/pids/munged.pid"     # remember that WE started it
fi
log "munge ok"

H=$(hostname -s)

# ---------------------------------------------------------------- 3. accounting (mariadb + slurmdbd)
if [ "$ACCT" = 1 ]; then
  DB="$DIR/mysql"; RUNDB="$DIR/mysqld"; SOCK="$RUNDB/mysqld.sock"   # mysqld-writable dirs
  mkdir -p "$RUNDB"; chown mysql:mysql "$RUNDB"
  if [ ! -d "$DB/mysql" ]; then
    mkdir -p "$DB"; chown mysql:mysql "$DB"
    mariadb-install-db --user=mysql --datadir="$DB" --auth-root-authentication-method=socket \
      --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed"
  fi
  if ! alive "$RUNDB/mariadbd.pid" mariadbd; then
    setsid nohup /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB" --socket="$SOCK" \
      --pid-file="$RUNDB/mariadbd.pid" --bind-address=127.0.0.1 --port="$DBPORT" \
      --innodb-buffer-pool-size=128M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900 \
      --log-error="$RUNDB/mariadb.log" </dev/null >/dev/null 2>&1 &
    wait_for 60 mariadb-admin --socket="$SOCK" ping || die "mariadbd did not come up"
  fi
  mariadb --socket="$SOCK" -e "
    CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DBPASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "db setup failed"
  log "mariadb ok"

  cat >"$DBDCONF.new" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/pids/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DBPORT
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db
EOF
  DBD_CHANGED=0
  cmp -s "$DBDCONF.new" "$DBDCONF" || { mv "$DBDCONF.new" "$DBDCONF"; DBD_CHANGED=1; }
  rm -f "$DBDCONF.new"; chmod 600 "$DBDCONF"
  if [ "$DBD_CHANGED" = 1 ] && alive "$DIR/pids/slurmdbd.pid" slurmdbd; then
    kill "$(cat "$DIR/pids/slurmdbd.pid")"; sleep 1
  fi
  alive "$DIR/pids/slurmdbd.pid" slurmdbd || slurmdbd || die "slurmdbd failed to start"
  # slurmdbd is ready when it listens on 6819 (sacctmgr needs slurm.conf, written below)
  wait_for 60 bash -c '</dev/tcp/127.0.0.1/6819' || die "slurmdbd not listening"
  log "slurmdbd ok"
  ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
  ACCT_LINES="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi

# ---------------------------------------------------------------- 4. slurm.conf
MEM=$(( $(awk '/^MemTotal:/{print int($2/1024)}' /proc/meminfo) - MARGIN ))
if [ -n "${SLURM_CI_CPUS:-}" ]; then
  NODE="NodeName=$H CPUs=$SLURM_CI_CPUS"; OVR="SlurmdParameters=config_overrides"
else   # exact topology as slurmd sees it (avoids 'reconfigured socket/core boundaries')
  NODE=$(slurmd -C | head -n1 | sed -E 's/ RealMemory=[0-9]+//'); OVR=""
fi
cat >"$CONF.new" <<EOF
# generated by start-slurm.sh
ClusterName=ci
SlurmctldHost=$H(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/pids/slurmctld.pid
SlurmdPidFile=$DIR/pids/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=512
ReturnToService=2
MailProg=/bin/true
MinJobAge=600
KillWait=10
$ACCT_LINES
JobCompType=jobcomp/none
$OVR
$NODE NodeAddr=127.0.0.1 RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
CONF_CHANGED=0
cmp -s "$CONF.new" "$CONF" || { mv "$CONF.new" "$CONF"; CONF_CHANGED=1; }
rm -f "$CONF.new"; chmod 644 "$CONF"

stop_pid() {  # stop_pid PIDFILE COMM
  alive "$1" "$2" || return 0
  local p; p=$(cat "$1"); kill "$p"
  for _ in $(seq 100); do [ -d "/proc/$p" ] || return 0; sleep 0.1; done
  kill -9 "$p" 2>/dev/null || true
}
if [ "$CONF_CHANGED" = 1 ]; then
  log "slurm.conf (re)written"
  stop_pid "$DIR/pids/slurmd.pid" slurmd
  stop_pid "$DIR/pids/slurmctld.pid" slurmctld
fi

# ---------------------------------------------------------------- 5. slurmctld + slurmd
alive "$DIR/pids/slurmctld.pid" slurmctld || slurmctld || die "slurmctld failed to start"
wait_for 30 scontrol ping || die "slurmctld not answering"
alive "$DIR/pids/slurmd.pid" slurmd || slurmd || die "slurmd failed to start"

state() { sinfo -h -N -n "$H" -o %T 2>/dev/null | tr -d '*~#$@+' ; }
for _ in $(seq 300); do
  case "$(state)" in
    idle|mixed|allocated|completing) break ;;
    down|drained|draining|drain*) scontrol update NodeName="$H" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 0.2
done
case "$(state)" in idle|mixed|allocated|completing) ;; *) die "node $H state '$(state)'" ;; esac
[ "$ACCT" = 1 ] && { wait_for 30 sh -c "sacctmgr -n -P list cluster format=cluster | grep -qx ci" || die "cluster not registered in slurmdbd"; }
log "cluster up: $(sinfo -h -o '%P %a %D %T %N')"
