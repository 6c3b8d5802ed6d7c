#!/bin/sh
# busybox udhcpc's hook in the duck boot image: applies the lease to the interface.
case "$1" in
    deconfig)
        ip -4 addr flush dev "$interface"
        ;;
    bound|renew)
        if [ "$(cat /run/duck-ip 2>/dev/null)" != "$ip" ]; then
            ip -4 addr flush dev "$interface"
            ip addr add "$ip/${mask:-24}" ${broadcast:+broadcast "$broadcast"} dev "$interface"
            echo "$ip" > /run/duck-ip
        fi
        for r in $router; do
            ip route replace default via "$r" dev "$interface"
            break
        done
        echo "duck-init: $interface has $ip/${mask:-24} (lease $lease s)"
        ;;
esac
exit 0
