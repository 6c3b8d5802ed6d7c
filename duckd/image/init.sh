#!/bin/busybox sh
# /init of the duck boot image (PID 1): modules, the NIC by DHCP, the weight cache
# (a local disk when there is one, else RAM), then duckfw, restarted whenever it exits.
# Settings: /etc/duck/duck.conf (from `duckctl image build`), overridden per duck on the
# kernel command line (duck.id=, duck.mac=, duck.cache=, duck.threads=) by duckd's boot script.
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /run /tmp /cache /var/run
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
exec </dev/console >/dev/console 2>&1

say() { echo "duck-init [$(cut -d" " -f1 /proc/uptime) s]: $*"; }

. /etc/duck/duck.conf
DUCK_ID=0
DUCK_MAC=""
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        duck.id=*) DUCK_ID="${arg#duck.id=}" ;;
        duck.mac=*) DUCK_MAC="${arg#duck.mac=}" ;;
        duck.cache=*) DUCK_CACHE="${arg#duck.cache=}" ;;
        duck.threads=*) DUCK_THREADS="${arg#duck.threads=}" ;;
    esac
done
say "duck $DUCK_ID, image $(cat /etc/duck/version)"

for m in $(cat /etc/duck/modules); do
    insmod "/lib/modules/$m" 2>/dev/null
done

# the NIC: the one whose MAC the boot firmware used, else the first Ethernet one with a link
nic=""
for tries in $(seq 1 50); do
    for dev in /sys/class/net/*; do
        name="${dev##*/}"
        [ "$name" = lo ] && continue
        if [ -n "$DUCK_MAC" ]; then
            [ "$(cat "$dev/address")" = "$DUCK_MAC" ] && nic="$name"
        elif [ -z "$nic" ]; then
            nic="$name"
        fi
    done
    [ -n "$nic" ] && break
    sleep 0.2
done
if [ -z "$nic" ]; then
    say "no network interface${DUCK_MAC:+ with MAC $DUCK_MAC}: the image lacks its driver (fleet.pxe.modules)"
    exec sh
fi
ip link set lo up
ip link set "$nic" up
say "DHCP on $nic"
# in the foreground until the first lease, then in the background renewing it
until udhcpc -i "$nic" -s /etc/duck/udhcpc.sh -x hostname:"duck$DUCK_ID" -t 5 -T 2 -A 2 -S; do
    say "no DHCP lease on $nic yet"
done
ip=$(cat /run/duck-ip)

# the cache: a device named on the command line (formatted when blank), else a partition
# labelled duckcache, else RAM
cache_opt="--memory-cache"
case "$DUCK_CACHE" in
    auto) for tries in 1 2 3 4 5; do   # disks may still be probing
            dev=$(findfs LABEL=duckcache 2>/dev/null) && break
            sleep 0.2
        done ;;
    ram) dev="" ;;
    /dev/*) dev="$DUCK_CACHE"
        # formatted only when blank: its first 64 KiB all zero (no partition table, no filesystem)
        if [ -b "$dev" ] && [ "$(dd if="$dev" bs=65536 count=1 2>/dev/null | tr -d '\000' | wc -c)" = 0 ]; then
            say "formatting the blank cache disk $dev"
            mke2fs -q -L duckcache "$dev"
        fi ;;
    *) say "duck.cache=$DUCK_CACHE: expected auto, ram or /dev/NAME; using RAM"; dev="" ;;
esac
if [ -n "$dev" ] && mount -t ext4 "$dev" /cache; then
    mkdir -p /cache/weights
    cache_opt="--cache-dir /cache/weights"
    say "weight cache on $dev"
elif [ -n "$dev" ]; then
    say "weight cache in RAM: mounting $dev failed"
else
    say "weight cache in RAM (no local disk)"
fi
capacity="$DUCK_CACHE_CAPACITY"
if [ "$capacity" = auto ]; then   # all memory but a reserve for the kernel, the image and the staging
    mem_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
    mem_mb=$((mem_kb / 1024))
    capacity=$((mem_mb - DUCK_RESERVE_MB))
    [ "$capacity" -lt $((mem_mb / 2)) ] && capacity=$((mem_mb / 2))
    capacity="${capacity}M"
fi
threads="$DUCK_THREADS"
[ "$threads" = 0 ] && threads=$(nproc)

while true; do
    say "duckfw on $ip:$DUCK_PORT, $threads threads, cache $capacity"
    duckfw --bind "$ip" --port "$DUCK_PORT" --id "$DUCK_ID" $cache_opt --cache-capacity "$capacity" \
        --key-file /etc/duck/fleet.key --threads "$threads" --idle "$DUCK_IDLE" --spin-us "${DUCK_SPIN_US:-1000}" --mtu auto \
        --log-level "$DUCK_LOG_LEVEL" $DUCK_EXTRA
    say "duckfw exited with status $?: starting it again in 1 s"
    sleep 1
done
