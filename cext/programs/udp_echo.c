/* domus-udp-echo: the floor of a UDP service on this machine.  One
 * recvfrom and one sendto per datagram, the datagram sent back unchanged,
 * nothing else: no parsing, no storage, no batching.  What a Domus service
 * spends per request beyond this loop's CPU is the cost of being a DHT
 * (benchmarks.put1 and benchmarks.capacity run it beside a service).
 *
 *   domus-udp-echo HOST:PORT      serve until SIGTERM or SIGINT
 *
 * It prints "listening on HOST:PORT" once bound (a port of 0 is chosen by
 * the kernel, and printed), then, when stopped, the datagrams it echoed.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static volatile sig_atomic_t stopping;

/* Asks the loop to end (recvfrom returns EINTR: no SA_RESTART). */
static void
stop(int signal_number)
{
    (void)signal_number;
    stopping = 1;
}

int
main(int argc, char **argv)
{
    char host[256], *colon, buffer[65536];
    struct addrinfo hints, *found;
    unsigned long long echoed = 0;

    if (argc != 2 || strlen(argv[1]) >= sizeof(host) || strrchr(argv[1], ':') == NULL) {
        fprintf(stderr, "usage: domus-udp-echo HOST:PORT\n");
        return 2;
    }
    snprintf(host, sizeof(host), "%s", argv[1]);
    colon = strrchr(host, ':');
    *colon = '\0';
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    hints.ai_flags = AI_PASSIVE;
    int status = getaddrinfo(host, colon + 1, &hints, &found);
    if (status != 0) {
        fprintf(stderr, "domus-udp-echo: %s: %s\n", argv[1], gai_strerror(status));
        return 2;
    }
    int fd = socket(found->ai_family, SOCK_DGRAM, 0);
    if (fd < 0 || bind(fd, found->ai_addr, found->ai_addrlen) != 0) {
        fprintf(stderr, "domus-udp-echo: cannot bind %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    freeaddrinfo(found);
    int size = 4 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));

    struct sockaddr_storage bound;
    socklen_t bound_length = sizeof(bound);
    char bound_host[NI_MAXHOST], bound_port[NI_MAXSERV];
    getsockname(fd, (struct sockaddr *)&bound, &bound_length);
    getnameinfo((struct sockaddr *)&bound, bound_length, bound_host, sizeof(bound_host),
                bound_port, sizeof(bound_port), NI_NUMERICHOST | NI_NUMERICSERV);
    printf("listening on %s:%s\n", bound_host, bound_port);
    fflush(stdout);

    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = stop;
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGINT, &action, NULL);

    while (!stopping) {
        struct sockaddr_storage peer;
        socklen_t peer_length = sizeof(peer);
        ssize_t got = recvfrom(fd, buffer, sizeof(buffer), 0, (struct sockaddr *)&peer,
                               &peer_length);
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            fprintf(stderr, "domus-udp-echo: recvfrom: %s\n", strerror(errno));
            return 1;
        }
        if (sendto(fd, buffer, (size_t)got, 0, (struct sockaddr *)&peer, peer_length) >= 0) {
            echoed++;
        }
    }
    printf("echoed %llu datagrams\n", echoed);
    return 0;
}
