/* duckfw: command line, start-up, and the serve loop. */
#define _GNU_SOURCE
#include "duckfw.h"
#include "net_linux.h"

#include <errno.h>
#include <getopt.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <signal.h>
#include <sys/prctl.h>

/* a query period shorter than a round trip would refuse the host's own requests; a day is plenty */
#define QUERY_PERIOD_MIN_MS 10u
#define QUERY_PERIOD_MAX_MS 86400000u

static void usage(FILE *f)
{
    fprintf(f,
            "usage: duckfw --cache-dir DIR|--memory-cache --key-file FILE [options]\n"
            "  --bind ADDR              IPv4 address to bind (default 127.0.0.1)\n"
            "  --port N                 UDP port, 0 for any free one (default 0)\n"
            "  --port-file FILE         write the bound port there once listening\n"
            "  --id N                   duck id announced in hello (default 0)\n"
            "  --cache-dir DIR          weight cache directory (created if missing)\n"
            "  --memory-cache           no cache directory: weights in memory only, gone at exit\n"
            "                           (a disk-less duck, whose files would be RAM too)\n"
            "  --cache-capacity SIZE    bytes of weights held, e.g. 512M, 24G (default 1G)\n"
            "  --threads N              worker threads incl. the main one (default: CPUs)\n"
            "  --pin                    pin workers to CPUs (dedicated hardware only)\n"
            "  --key-file FILE          shared key: the file's bytes, one trailing newline\n"
            "                           dropped, %d..%d bytes\n"
            "  --idle block|spin        block when idle (default), or spin-then-block: poll for\n"
            "                           --spin-us, yielding the CPU, then block\n"
            "  --spin-us N              spin time for --idle spin (default 50)\n"
            "  --mtu N|auto             largest datagram taken and sent, IP/UDP headers included,\n"
            "                           %d..%d; auto or 0 (default): the MTU of the interface of --bind\n"
            "                           (loopback 65535); the host agrees its size at hello\n"
            "  --no-data-mac            take forwards (and send their partials) without a MAC: for\n"
            "                           trusted links only; by default forwards need the link MAC\n"
            "  --query-period-ms N      a new query nonce (what read-only requests must name) every\n"
            "                           N ms, the one before taken N ms more, %u..%u (default %u)\n"
            "  --log-level error|warn|info|debug (default info)\n"
            "  test only, refused without --enable-fault-injection:\n"
            "  --drop-rate F            drop this fraction of datagrams in and out\n"
            "  --delay-us N             delay before handling each request\n"
            "  --fault-seed N           seed of the drop pattern\n"
            "  --parent-pid PID         exit (SIGTERM) when the process PID that started this duck ends\n",
            WIRE_KEY_MIN, WIRE_KEY_MAX, WIRE_MTU_MIN, WIRE_MTU_MAX, QUERY_PERIOD_MIN_MS, QUERY_PERIOD_MAX_MS,
            DUCK_QUERY_PERIOD_MS);
}

static int parse_size(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0)
        return -1;
    double mul = 1;
    switch (*end) {
    case 'k': case 'K': mul = 1024.0; end++; break;
    case 'm': case 'M': mul = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mul = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (*end == 'B' || *end == 'b')
        end++;
    if (*end)
        return -1;
    *out = (uint64_t)(v * mul);
    return 0;
}

static int parse_uint(const char *s, unsigned long max, unsigned long *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || end == s || *end || v > max || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

static int read_key(const char *path, wire_key *key)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "duckfw: cannot open key file %s: %s\n", path, strerror(errno));
        return -1;
    }
    uint8_t buf[WIRE_KEY_MAX + 2];
    size_t n = fread(buf, 1, sizeof buf, f);
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && (st.st_mode & 077))
        fprintf(stderr, "duckfw: warning: key file %s is readable by others (mode %03o)\n", path,
                (unsigned)(st.st_mode & 0777));
    fclose(f);
    if (n && buf[n - 1] == '\n')
        n--;
    if (n < WIRE_KEY_MIN || n > WIRE_KEY_MAX) {
        fprintf(stderr, "duckfw: key file %s holds %zu bytes; a key is %d..%d bytes\n", path, n, WIRE_KEY_MIN,
                WIRE_KEY_MAX);
        return -1;
    }
    memcpy(key->bytes, buf, n);
    key->len = (uint32_t)n;
    return 0;
}

/* SIGTERM to this duck when the thread of its parent that started it ends (the
 * daemon killed too); a parent already gone by now means it should not run. */
static int die_with_parent(pid_t parent)
{
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) {
        fprintf(stderr, "duckfw: prctl(PR_SET_PDEATHSIG): %s\n", strerror(errno));
        return -1;
    }
    if (getppid() != parent) {
        fprintf(stderr, "duckfw: the parent process %d is gone: exiting\n", (int)parent);
        return -1;
    }
    return 0;
}

#define BAD(...) do { fprintf(stderr, "duckfw: " __VA_ARGS__); fputc('\n', stderr); return 2; } while (0)

int main(int argc, char **argv)
{
    enum { O_BIND = 256, O_PORT, O_PORT_FILE, O_ID, O_CACHE_DIR, O_CAPACITY, O_THREADS, O_PIN, O_KEY, O_IDLE,
           O_SPIN, O_MTU, O_MEMCACHE, O_DATA_MAC, O_NO_DATA_MAC, O_LOG, O_FAULTS, O_DROP, O_DELAY, O_SEED, O_HELP, O_VERSION, O_PARENT,
           O_QUERY_PERIOD };
    static const struct option opts[] = {
        {"bind", 1, 0, O_BIND}, {"port", 1, 0, O_PORT}, {"port-file", 1, 0, O_PORT_FILE}, {"id", 1, 0, O_ID},
        {"cache-dir", 1, 0, O_CACHE_DIR}, {"memory-cache", 0, 0, O_MEMCACHE}, {"cache-capacity", 1, 0, O_CAPACITY}, {"threads", 1, 0, O_THREADS},
        {"pin", 0, 0, O_PIN}, {"key-file", 1, 0, O_KEY}, {"idle", 1, 0, O_IDLE}, {"spin-us", 1, 0, O_SPIN},
        {"mtu", 1, 0, O_MTU}, {"data-mac", 0, 0, O_DATA_MAC}, {"no-data-mac", 0, 0, O_NO_DATA_MAC}, {"log-level", 1, 0, O_LOG},
        {"enable-fault-injection", 0, 0, O_FAULTS}, {"drop-rate", 1, 0, O_DROP}, {"delay-us", 1, 0, O_DELAY},
        {"fault-seed", 1, 0, O_SEED}, {"help", 0, 0, O_HELP}, {"version", 0, 0, O_VERSION},
        {"parent-pid", 1, 0, O_PARENT}, {"query-period-ms", 1, 0, O_QUERY_PERIOD}, {0, 0, 0, 0}};
    duck_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.bind_addr = "127.0.0.1";
    cfg.cache_capacity = 1ull << 30;
    cfg.mtu = 0;   /* auto */
    cfg.data_mac = 1;
    const char *key_file = NULL;
    pid_t parent = 0;
    int spin = 0, faults_allowed = 0, fault_opts = 0, level = DLOG_INFO, memory_cache = 0;
    unsigned long spin_us = 50, v;
    cpu_set_t cpus;
    cfg.threads = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? (unsigned)CPU_COUNT(&cpus) : 1;
    for (int o; (o = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
        switch (o) {
        case O_BIND: cfg.bind_addr = optarg; break;
        case O_PORT: if (parse_uint(optarg, 65535, &v)) BAD("--port %s is not 0..65535", optarg); cfg.port = (uint16_t)v; break;
        case O_PORT_FILE: cfg.port_file = optarg; break;
        case O_ID: if (parse_uint(optarg, UINT32_MAX, &v)) BAD("--id %s is not a number", optarg); cfg.duck_id = (uint32_t)v; break;
        case O_CACHE_DIR: cfg.cache_dir = optarg; break;
        case O_MEMCACHE: memory_cache = 1; break;
        case O_CAPACITY: if (parse_size(optarg, &cfg.cache_capacity)) BAD("--cache-capacity %s is not a size like 512M", optarg); break;
        case O_THREADS: if (parse_uint(optarg, 256, &v) || !v) BAD("--threads %s is not 1..256", optarg); cfg.threads = (unsigned)v; break;
        case O_PIN: cfg.pin = 1; break;
        case O_KEY: key_file = optarg; break;
        case O_IDLE:
            if (strcmp(optarg, "block") && strcmp(optarg, "spin")) BAD("--idle %s: expected block or spin", optarg);
            spin = strcmp(optarg, "spin") == 0;
            break;
        case O_SPIN: if (parse_uint(optarg, 1000000, &spin_us)) BAD("--spin-us %s is not 0..1000000", optarg); break;
        case O_MTU:
            if (strcmp(optarg, "auto") == 0) { cfg.mtu = 0; break; }
            if (parse_uint(optarg, WIRE_MTU_MAX, &v) || (v && v < WIRE_MTU_MIN)) BAD("--mtu %s is not auto (0) or %d..%d", optarg, WIRE_MTU_MIN, WIRE_MTU_MAX);
            cfg.mtu = (uint32_t)v;
            break;
        case O_DATA_MAC: cfg.data_mac = 1; break;   /* the default; kept for old command lines */
        case O_NO_DATA_MAC: cfg.data_mac = 0; break;
        case O_QUERY_PERIOD:
            if (parse_uint(optarg, QUERY_PERIOD_MAX_MS, &v) || v < QUERY_PERIOD_MIN_MS)
                BAD("--query-period-ms %s is not %u..%u", optarg, QUERY_PERIOD_MIN_MS, QUERY_PERIOD_MAX_MS);
            cfg.query_period_ms = (uint32_t)v;
            break;
        case O_LOG:
            level = !strcmp(optarg, "error") ? DLOG_ERROR : !strcmp(optarg, "warn") ? DLOG_WARN
                  : !strcmp(optarg, "info") ? DLOG_INFO : !strcmp(optarg, "debug") ? DLOG_DEBUG : -1;
            if (level < 0) BAD("--log-level %s: expected error, warn, info or debug", optarg);
            break;
        case O_FAULTS: faults_allowed = 1; break;
        case O_DROP: {
            char *end;
            cfg.drop_rate = strtod(optarg, &end);
            if (*end || cfg.drop_rate < 0 || cfg.drop_rate > 1) BAD("--drop-rate %s is not 0..1", optarg);
            fault_opts = 1;
            break;
        }
        case O_DELAY: if (parse_uint(optarg, 10000000, &v)) BAD("--delay-us %s is not 0..10000000", optarg); cfg.delay_us = (uint32_t)v; fault_opts = 1; break;
        case O_SEED: if (parse_uint(optarg, UINT32_MAX, &v)) BAD("--fault-seed %s is not a number", optarg); cfg.fault_seed = (uint32_t)v; break;
        case O_PARENT: if (parse_uint(optarg, INT32_MAX, &v) || !v) BAD("--parent-pid %s is not a process id", optarg); parent = (pid_t)v; break;
        case O_HELP: usage(stdout); return 0;
        case O_VERSION: printf("%s (wire v%d, abi %d)\n", DUCKFW_NAME, WIRE_VERSION, WIRE_ABI); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc)
        BAD("unexpected argument %s (see --help)", argv[optind]);
    if (memory_cache && cfg.cache_dir)
        BAD("--memory-cache and --cache-dir %s exclude each other: pick one", cfg.cache_dir);
    if (!cfg.cache_dir && !memory_cache)
        BAD("--cache-dir DIR or --memory-cache is required (see --help)");
    if (memory_cache)
        cfg.cache_dir = "";    /* cache_open: no directory, nothing persisted */
    if (!key_file)
        BAD("--key-file is required: a duck accepts sessions only from a host that proves the shared key");
    if (fault_opts && !faults_allowed)
        BAD("--drop-rate and --delay-us are test-only fault injection; pass --enable-fault-injection to allow them");
    if (read_key(key_file, &cfg.key))
        return 2;
    cfg.faults = faults_allowed && fault_opts;
    cfg.spin_us = spin ? (unsigned)spin_us : 0;
    if (cfg.spin_us && cfg.pin == 0)
        fprintf(stderr, "duckfw: note: --idle spin polls up to %u us after each datagram (yielding the CPU); on a "
                "host shared with other work keep --idle block\n", cfg.spin_us);

    dlog_init(cfg.duck_id, level);
    net_install_signals();
    if (parent && die_with_parent(parent) != 0)
        return 1;
    char ifname[IF_NAMESIZE + 1] = "";
    if (!cfg.mtu) {
        uint32_t mtu = net_detect_mtu(cfg.bind_addr, ifname, sizeof ifname);
        cfg.mtu = mtu < WIRE_MTU_MIN ? WIRE_MTU_DEFAULT : mtu;
        if (!mtu)
            dlog(DLOG_WARN, "no interface found for %s: datagrams of %u bytes", cfg.bind_addr, cfg.mtu);
    }
    if (!cfg.data_mac)
        dlog(DLOG_WARN, "--no-data-mac: forwards and their partials travel without a MAC; for trusted links only");
    if (cfg.faults)
        dlog(DLOG_WARN, "FAULT INJECTION ON: drop rate %.3f, delay %u us (tests only)", cfg.drop_rate, cfg.delay_us);
    uint16_t port = 0;
    static int fd;
    fd = net_open(cfg.bind_addr, cfg.port, &port);
    if (fd < 0)
        return 1;
    static duck_core core;
    if (core_init(&core, &cfg, net_send, &fd) != 0) {
        core_free(&core);
        return 1;
    }
    core.cores = (uint64_t)sysconf(_SC_NPROCESSORS_ONLN);
    core.mem_bytes = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    if (cfg.port_file) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", cfg.port_file);
        FILE *f = fopen(tmp, "w");
        int bad = !f || fprintf(f, "%u\n", port) < 0;
        bad = (f && fclose(f) != 0) || bad || rename(tmp, cfg.port_file) != 0;
        if (bad) {
            int err = errno;
            unlink(tmp);   /* a full disk leaves no empty port.tmp behind */
            dlog(DLOG_ERROR, "cannot write the port file %s: %s", cfg.port_file, strerror(err));
            core_free(&core);
            return 1;
        }
    }
    dlog(DLOG_INFO, "%s listening on %s:%u (duck %u, mtu %u%s%s)", DUCKFW_NAME, cfg.bind_addr, port, cfg.duck_id,
         cfg.mtu, ifname[0] ? " of " : "", ifname);
    net_serve(&core, fd);
    core_free(&core);
    close(fd);
    dlog(DLOG_INFO, "stopped");
    return 0;
}
