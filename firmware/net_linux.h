/* The Linux platform layer of duckfw: UDP socket and serve loop. */
#ifndef DUCKFW_NET_LINUX_H
#define DUCKFW_NET_LINUX_H

#include <stddef.h>

#include "duckfw.h"

void net_install_signals(void);
/* Binds addr:port (0: any free port); returns the socket or -1 (logged). */
int net_open(const char *addr, uint16_t port, uint16_t *bound_port);
/* The MTU of the interface that serves addr (for 0.0.0.0 the largest of the
 * interfaces that are up, loopback only when alone), capped at WIRE_MTU_MAX;
 * its name into ifname. 0 when none is found. */
uint32_t net_detect_mtu(const char *addr, char *ifname, size_t ifname_len);
/* duck_send_fn over the socket; ctx points to the fd. */
void net_send(void *ctx, const duck_peer *to, uint8_t *const *dgrams, const size_t *lens, unsigned n);
/* Serves until SIGINT/SIGTERM or an accepted SHUTDOWN. */
int net_serve(duck_core *core, int fd);

#endif
