/* Linux platform layer: one UDP socket, recvmmsg/sendmmsg batches, the
 * serve loop, and the MTU of the interface the duck serves on. Idle
 * strategy: block in recvmmsg (the default: ducks that share a host must not
 * spin), or spin for spin_us on MSG_DONTWAIT first, yielding the CPU on
 * every empty poll so that an oversubscribed core still runs its other
 * threads, then block. Each datagram's kernel receive timestamp is handed to
 * the core (rx_ns): it reports the wake-up, arrival to kernel start. */
#define _GNU_SOURCE
#include "net_linux.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RECV_BATCH CORE_BATCH_MAX
#define SOCKET_BUFFER (16 << 20)
/* The rest of a message whose first fragments arrived is microseconds
 * away: poll for it this long rather than sleep and wake per fragment. */
#define MID_MESSAGE_SPIN_US 50
#define STOP_CHECK_US 200000

static volatile sig_atomic_t stop_signal;

static void on_signal(int sig) { stop_signal = sig; }

void net_install_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;   /* no SA_RESTART: recvmmsg returns EINTR */
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

static void grow_buffer(int fd, int opt, int force_opt, const char *what)
{
    int want = SOCKET_BUFFER, got = 0;
    socklen_t len = sizeof got;
    if (setsockopt(fd, SOL_SOCKET, force_opt, &want, sizeof want) != 0)
        setsockopt(fd, SOL_SOCKET, opt, &want, sizeof want);
    getsockopt(fd, SOL_SOCKET, opt, &got, &len);
    if (got < want / 4)
        dlog(DLOG_WARN, "socket %s buffer is %d bytes (wanted %d); raise net.core.%cmem_max to avoid drops",
             what, got, want, opt == SO_RCVBUF ? 'r' : 'w');
}

int net_open(const char *addr, uint16_t port, uint16_t *bound_port)
{
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    if (inet_pton(AF_INET, addr, &sa.sin_addr) != 1) {
        dlog(DLOG_ERROR, "bind address %s is not an IPv4 address", addr);
        return -1;
    }
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        dlog(DLOG_ERROR, "socket: %s", strerror(errno));
        return -1;
    }
    grow_buffer(fd, SO_RCVBUF, SO_RCVBUFFORCE, "receive");
    grow_buffer(fd, SO_SNDBUF, SO_SNDBUFFORCE, "send");
    /* a blocking receive returns now and then: a signal that lands between the
     * loop's check of stop_signal and the receive is seen within this */
    struct timeval tick = {0, STOP_CHECK_US};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tick, sizeof tick);
    int on = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof on) != 0)
        dlog(DLOG_WARN, "no receive timestamps (%s): wake-up times are not reported", strerror(errno));
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        dlog(DLOG_ERROR, "cannot bind %s:%u: %s", addr, port, strerror(errno));
        close(fd);
        return -1;
    }
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    *bound_port = ntohs(sa.sin_port);
    return fd;
}

void net_send(void *ctx, const duck_peer *to, uint8_t *const *dgrams, const size_t *lens, unsigned n)
{
    int fd = *(int *)ctx;
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = to->addr;
    sa.sin_port = to->port;
    struct mmsghdr msgs[64];
    struct iovec iov[64];
    unsigned sent = 0;
    while (sent < n) {
        unsigned k = n - sent < 64 ? n - sent : 64;
        for (unsigned i = 0; i < k; i++) {
            iov[i].iov_base = dgrams[sent + i];
            iov[i].iov_len = lens[sent + i];
            memset(&msgs[i], 0, sizeof msgs[i]);
            msgs[i].msg_hdr.msg_name = &sa;
            msgs[i].msg_hdr.msg_namelen = sizeof sa;
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
        }
        int r = sendmmsg(fd, msgs, k, 0);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == ENOBUFS || errno == EAGAIN) {   /* the host retransmits what was lost */
                struct timespec d = {0, 50000};
                nanosleep(&d, NULL);
                continue;
            }
            dlog(DLOG_WARN, "sendmmsg: %s; %u datagram(s) not sent", strerror(errno), n - sent);
            return;
        }
        sent += (unsigned)r;
    }
}

uint32_t net_detect_mtu(const char *addr, char *ifname, size_t ifname_len)
{
    struct in_addr want;
    struct ifaddrs *ifs = NULL;
    if (inet_pton(AF_INET, addr, &want) != 1 || getifaddrs(&ifs) != 0)
        return 0;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    uint32_t best = 0, best_lo = 0;
    for (struct ifaddrs *i = ifs; i && fd >= 0; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP) || !i->ifa_netmask)
            continue;
        uint32_t a = ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr;
        uint32_t m = ((struct sockaddr_in *)i->ifa_netmask)->sin_addr.s_addr;
        if (want.s_addr != INADDR_ANY && (a & m) != (want.s_addr & m))
            continue;   /* bound to an address: the interface of its subnet */
        struct ifreq ifr;
        memset(&ifr, 0, sizeof ifr);
        snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", i->ifa_name);
        if (ioctl(fd, SIOCGIFMTU, &ifr) != 0 || ifr.ifr_mtu <= 0)
            continue;
        uint32_t mtu = (uint32_t)ifr.ifr_mtu;
        /* any address: the largest of the real interfaces; loopback only when it is all there is */
        uint32_t *slot = (i->ifa_flags & IFF_LOOPBACK) && want.s_addr == INADDR_ANY ? &best_lo : &best;
        if (mtu > *slot) {
            *slot = mtu;
            if (slot == &best || !best)
                snprintf(ifname, ifname_len, "%s", i->ifa_name);
        }
    }
    if (fd >= 0)
        close(fd);
    freeifaddrs(ifs);
    uint32_t mtu = best ? best : best_lo;
    return mtu > WIRE_MTU_MAX ? WIRE_MTU_MAX : mtu;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* The kernel's receive time of a datagram (CLOCK_REALTIME) on the monotonic
 * clock the core uses; 0 without a timestamp. */
static uint64_t arrival_ns(struct msghdr *m, const struct timespec *real, const struct timespec *mono)
{
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(m); cm; cm = CMSG_NXTHDR(m, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_TIMESTAMPNS)
            continue;
        struct timespec ts;
        memcpy(&ts, CMSG_DATA(cm), sizeof ts);
        int64_t age = (int64_t)(real->tv_sec - ts.tv_sec) * 1000000000 + (real->tv_nsec - ts.tv_nsec);
        uint64_t now = (uint64_t)mono->tv_sec * 1000000000u + (uint64_t)mono->tv_nsec;
        return age > 0 && (uint64_t)age < now ? now - (uint64_t)age : now;
    }
    return 0;
}

int net_serve(duck_core *core, int fd)
{
    static uint8_t bufs[RECV_BATCH][WIRE_MAX_DATAGRAM + 1] __attribute__((aligned(64)));
    struct mmsghdr msgs[RECV_BATCH];
    struct iovec iov[RECV_BATCH];
    struct sockaddr_in from[RECV_BATCH];
    static union {
        char buf[CMSG_SPACE(sizeof(struct timespec)) + 64];
        struct cmsghdr align;
    } ctl[RECV_BATCH];
    for (int i = 0; i < RECV_BATCH; i++) {
        iov[i].iov_base = bufs[i];
        iov[i].iov_len = sizeof bufs[i];
        memset(&msgs[i], 0, sizeof msgs[i]);
        msgs[i].msg_hdr.msg_name = &from[i];
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_control = ctl[i].buf;
    }
    int n = 0;
    while (!stop_signal && !core->shutdown) {
        for (int i = 0; i < (n > 0 ? n : RECV_BATCH); i++) {   /* the kernel overwrote them */
            msgs[i].msg_hdr.msg_namelen = sizeof from[i];
            msgs[i].msg_hdr.msg_controllen = sizeof ctl[i].buf;
        }
        n = -1;
        /* after a fragment, or a dropped datagram (a flood: the next follows in microseconds), poll briefly
         * before blocking: a sleep and a wake-up per datagram would cost more than the datagram itself */
        unsigned spin_us = core->mid_message || core->dropped ? MID_MESSAGE_SPIN_US : 0;
        if (core->cfg.spin_us > spin_us)
            spin_us = core->cfg.spin_us;
        if (spin_us) {
            double until = now_us() + spin_us;
            while ((n = recvmmsg(fd, msgs, RECV_BATCH, MSG_DONTWAIT, NULL)) < 0 && errno == EAGAIN &&
                   now_us() < until && !stop_signal)
                sched_yield();
        }
        if (n < 0 && !stop_signal)
            n = recvmmsg(fd, msgs, RECV_BATCH, MSG_WAITFORONE, NULL);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || stop_signal)
                continue;
            dlog(DLOG_ERROR, "recvmmsg: %s; serving on", strerror(errno));
            struct timespec d = {0, 1000000};
            nanosleep(&d, NULL);
            continue;
        }
        struct timespec real, mono;
        clock_gettime(CLOCK_REALTIME, &real);
        clock_gettime(CLOCK_MONOTONIC, &mono);
        const uint8_t *ptrs[RECV_BATCH];
        size_t lens[RECV_BATCH];
        uint64_t rx_ns[RECV_BATCH];
        uint8_t drop[RECV_BATCH];
        duck_peer peers[RECV_BATCH];
        for (int i = 0; i < n; i++) {
            peers[i] = (duck_peer){from[i].sin_addr.s_addr, from[i].sin_port};
            ptrs[i] = bufs[i];
            lens[i] = msgs[i].msg_len;
            rx_ns[i] = arrival_ns(&msgs[i].msg_hdr, &real, &mono);
            drop[i] = (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) != 0;
        }
        core_batch(core, peers, ptrs, lens, rx_ns, drop, (unsigned)n);
    }
    if (stop_signal)
        dlog(DLOG_INFO, "signal %d: stopping", (int)stop_signal);
    return 0;
}
