/* The Linux platform layer of duckfw: UDP socket and serve loop. */
#ifndef DUCKFW_NET_LINUX_H
#define DUCKFW_NET_LINUX_H

#include "duckfw.h"

void net_install_signals(void);
/* Binds addr:port (0: any free port); returns the socket or -1 (logged). */
int net_open(const char *addr, uint16_t port, uint16_t *bound_port);
/* duck_send_fn over the socket; ctx points to the fd. */
void net_send(void *ctx, const duck_peer *to, uint8_t *const *dgrams, const size_t *lens, unsigned n);
/* Serves until SIGINT/SIGTERM or an accepted SHUTDOWN. */
int net_serve(duck_core *core, int fd);

#endif
