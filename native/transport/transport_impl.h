/* Private to native/transport*.c: the transport's state. */
#ifndef DUCK_TRANSPORT_IMPL_H
#define DUCK_TRANSPORT_IMPL_H

#include <netinet/in.h>
#include <sys/socket.h>

#include "transport.h"

#define BATCH 64

typedef struct call_state {
    uint32_t seq;
    int with_mac, done;
    uint32_t req_frags;
    uint64_t t_start, t_heard, t_next, interval;
    uint32_t rep_count, rep_have, rep_total;
    uint8_t bitmap[WIRE_MAX_FRAGMENTS / 8];
} call_state;

struct duck_transport {
    duck_transport_config cfg;
    wire_key key;
    int fd;
    uint16_t local_port;
    uint32_t seq;
    struct sockaddr_in *dest;
    int32_t *active;              /* duck -> call index during a run */
    call_state *st;
    uint8_t *seal;                /* sealed datagrams of one message */
    size_t seal_cap;
    uint8_t (*rx)[WIRE_MAX_DATAGRAM + 1];
    struct mmsghdr tx_msgs[BATCH];
    struct iovec tx_iov[BATCH];
    unsigned tx_n;
    uint8_t *fwd;                 /* forward request payload */
    size_t fwd_cap;
    uint8_t **replies;            /* per duck forward reply buffers */
    uint32_t *reply_caps;
    duck_call *fcalls;
    uint64_t rcvtimeo_us;         /* the socket's receive timeout now */
    int mid_message;              /* a reply is partly in: poll briefly for the rest */
    duck_transport_stats stats;
};

/* Shared by transport.c and transport_run.c. */
uint64_t tr_now_ns(void);
void tr_tx_flush(duck_transport *t);
void tr_tx_add(duck_transport *t, uint32_t duck, uint8_t *dgram, size_t len);
int tr_seal_room(duck_transport *t, uint32_t frags);
uint32_t tr_frag_count(const duck_transport *t, uint32_t total);
uint32_t tr_seal_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have,
                         size_t *lens, uint32_t *index);
void tr_send_request(duck_transport *t, const duck_call *c, const call_state *s, const uint8_t *have);
void tr_send_resend(duck_transport *t, const duck_call *c, const call_state *s);

#endif
