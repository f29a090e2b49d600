// Plain TCP carrying exactly a push/pull step's bytes: what the transport allows, with no protocol of ours.
// benchmarks/cluster/tcp_matrix.py builds it (cc -O2) and runs it; in C so that its own CPU stays far below the
// links' (a Python loop moving the same bytes saturated the 2 cores at n = 8).
//
//   tcp_matrix serve --port 9100 --workers 7 --bytes 4194304 [common options]
//   tcp_matrix push --servers 10.77.0.101:9100:4194304[:buffer bytes],... [common options]
//   common: --mode rounds|free --steps 7 --warmup 2 --partition-bytes 131072 --socket-buffer-bytes 0 --timeout 300
//           --pace-seconds 0 (> 0: every connection paced at its step bytes / this, SO_MAX_PACING_RATE)
//           --lead-bytes 0 (serve, > 0: read no worker's pushes more than this ahead of the slowest worker's)
//
// A `serve` process stands where a summation server stands and a `push` process where a worker does, one
// connection per worker and server (as ours). Every step, a worker writes each server its share of the bytes and
// reads as many back. No headers, no credit, no acknowledgements: only TCP and the socket buffers.
// - rounds: a server sends back a partition of a step only once every worker on another host has pushed it (the
//   worker on its own host never crosses a link), and a worker pushes a step once it has every reply of the one
//   before: a round's dependency and nothing else of ours.
//   With --lead-bytes a server also stops reading a worker that is that far ahead of the slowest one: the
//   unread bytes close its window, and its link's share goes to the others (a grant, in TCP's terms).
// - free: servers send back from the start and workers push every step at once: the traffic matrix alone. Every
//   step is timed, from the worker's first reply byte (the servers start once every worker is connected).
// Prints "tcp_matrix serving" once listening, then one `RESULT {json}` line: the worker's seconds per timed step
// (rounds: after the warm-up), and each process's cores over its run. Any failure: a message naming the peer on
// stderr, exit 1. Every wait is bounded by --timeout.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

enum { kMaxFlows = 512, kChunk = 1 << 18 };

typedef struct {
  int fd;
  char name[96];
  int64_t sent, received, may_send, may_receive, expect, share;
} Flow;

static char zeros[kChunk], sink[kChunk];

static void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  exit(1);
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

static double cpu_seconds(void) {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec / 1e6;
}

// Busy and total jiffies of all cores since boot (/proc/stat's first line), as benchmarks/cluster/cpu.py reads them.
static void machine_jiffies(long long* busy, long long* total) {
  long long v[8] = {0};
  FILE* f = fopen("/proc/stat", "r");
  if (!f || fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                   &v[7]) != 8)
    die("cannot read /proc/stat");
  fclose(f);
  *total = 0;
  for (int i = 0; i < 8; ++i) *total += v[i];
  *busy = *total - v[3] - v[4];  // less idle and iowait
}

static void tune(int fd, int buffer_bytes) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // as torch_bps's connections
  if (buffer_bytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
  }
}

// Move all a flow's socket takes and gives now; a peer that closes early is an error naming it.
static void pump(Flow* f, short revents) {
  if (revents & (POLLIN | POLLHUP | POLLERR)) {
    while (f->received < f->may_receive) {
      int64_t room = f->may_receive - f->received;
      ssize_t got = recv(f->fd, sink, room < kChunk ? room : kChunk, MSG_DONTWAIT);
      if (got == 0) die("%s closed after %lld bytes", f->name, (long long)f->received);
      if (got < 0) {
        if (errno == EAGAIN || errno == EINTR) break;
        die("%s: receive failed after %lld bytes: %s", f->name, (long long)f->received, strerror(errno));
      }
      f->received += got;
    }
  }
  if (revents & POLLOUT) {
    while (f->sent < f->may_send) {
      int64_t want = f->may_send - f->sent;
      ssize_t put = send(f->fd, zeros, want < kChunk ? want : kChunk, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (put < 0) {
        if (errno == EAGAIN || errno == EINTR) break;
        die("%s: send failed after %lld bytes: %s", f->name, (long long)f->sent, strerror(errno));
      }
      f->sent += put;
    }
  }
}

typedef struct {
  const char* role;
  const char* mode;
  const char* servers;
  int port, workers, steps, warmup, buffer_bytes;
  int64_t bytes, partition, lead;
  double timeout, pace_seconds;
} Args;

// Cap a connection's sending rate at `step_bytes` per `seconds` (TCP's own pacing: no qdisc needed).
static void pace(int fd, int64_t step_bytes, double seconds) {
  if (seconds <= 0) return;
  uint64_t rate = (uint64_t)(step_bytes / seconds);
  if (setsockopt(fd, SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof(rate))) die("SO_MAX_PACING_RATE: %s", strerror(errno));
}

typedef int (*Rule)(Flow* flows, int n, const Args* a, void* state);  // sets may_send; returns 1 when done

// Poll until `rule` says done or the deadline passes (then: an error naming every flow's counts).
static void run(Flow* flows, int n, const Args* a, Rule rule, void* state, double deadline, const char* what) {
  struct pollfd p[kMaxFlows];
  for (;;) {
    if (rule(flows, n, a, state)) return;
    for (int i = 0; i < n; ++i) {
      p[i].fd = flows[i].fd;
      p[i].events = (flows[i].received < flows[i].may_receive ? POLLIN : 0) | (flows[i].sent < flows[i].may_send ? POLLOUT : 0);
      if (!p[i].events) p[i].fd = -1;  // nothing to read or write: its peer's close is no error
    }
    double left = deadline - now();
    if (left <= 0) {
      fprintf(stderr, "%s: not done by the deadline (", what);
      for (int i = 0; i < n; ++i)
        fprintf(stderr, "%s%s: sent %lld, received %lld", i ? ", " : "", flows[i].name, (long long)flows[i].sent,
                (long long)flows[i].received);
      die(")");
    }
    int ready = poll(p, n, left < 1.0 ? (int)(left * 1000) + 1 : 1000);
    if (ready < 0 && errno != EINTR) die("%s: poll failed: %s", what, strerror(errno));
    for (int i = 0; ready > 0 && i < n; ++i)
      if (p[i].fd >= 0 && p[i].revents) pump(&flows[i], p[i].revents);
  }
}

// Bytes of the replies a server may send once every worker has pushed `pushed`: whole partitions of a step.
static int64_t released(int64_t pushed, const Args* a) {
  int64_t step = pushed / a->bytes, within = pushed % a->bytes;
  return step * a->bytes + within / a->partition * a->partition;
}

static int serve_rule(Flow* flows, int n, const Args* a, void* state) {
  (void)state;
  int64_t total = a->bytes * a->steps, least = total;
  for (int i = 0; i < n; ++i)
    if (flows[i].received < least) least = flows[i].received;
  int64_t allowed = strcmp(a->mode, "free") == 0 ? total : released(least, a);
  int done = 1;
  for (int i = 0; i < n; ++i) {
    flows[i].may_send = allowed;
    flows[i].may_receive = a->lead > 0 && least + a->lead < total ? least + a->lead : total;
    done &= flows[i].sent == total && flows[i].received == total;
  }
  return done;
}

typedef struct {
  double ends[1024];
  int ended;
  double timed_from;
  int timing;
} Steps;

static int push_rule(Flow* flows, int n, const Args* a, void* state) {
  Steps* s = state;
  int free_mode = strcmp(a->mode, "free") == 0;
  for (;;) {  // a step has ended when every server's reply for it is in
    if (s->ended == a->steps) break;
    int all = 1;
    for (int i = 0; i < n; ++i) all &= flows[i].received >= (int64_t)(s->ended + 1) * flows[i].share;
    if (!all) break;
    s->ends[s->ended++] = now();
  }
  if (!s->timing) {
    int any = 0;
    for (int i = 0; i < n; ++i) any |= flows[i].received > 0;
    if (free_mode ? any : s->ended >= a->warmup) {
      s->timing = 1;
      s->timed_from = !free_mode && a->warmup ? s->ends[a->warmup - 1] : now();
    }
  }
  int pushed = free_mode ? (s->timing ? a->steps : 0) : (s->ended + 1 < a->steps ? s->ended + 1 : a->steps);
  int done = s->ended == a->steps;
  for (int i = 0; i < n; ++i) {
    flows[i].may_send = (int64_t)pushed * flows[i].share;
    flows[i].may_receive = flows[i].expect;
    done &= flows[i].sent == flows[i].may_send;
  }
  return done;
}

static void serve(const Args* a) {
  double deadline = now() + a->timeout;
  int lfd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  tune(lfd, a->buffer_bytes);  // accepted sockets inherit the buffers
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(a->port), .sin_addr.s_addr = INADDR_ANY};
  if (bind(lfd, (struct sockaddr*)&addr, sizeof(addr)) || listen(lfd, a->workers))
    die("server: cannot listen on port %d: %s", a->port, strerror(errno));
  printf("tcp_matrix serving\n");
  fflush(stdout);
  static Flow flows[kMaxFlows];
  for (int i = 0; i < a->workers; ++i) {
    struct pollfd p = {.fd = lfd, .events = POLLIN};
    double left = deadline - now();
    if (left <= 0 || poll(&p, 1, (int)(left * 1000) + 1) <= 0)
      die("server on port %d: %d of %d workers connected by the deadline", a->port, i, a->workers);
    struct sockaddr_in peer;
    socklen_t len = sizeof(peer);
    flows[i].fd = accept(lfd, (struct sockaddr*)&peer, &len);
    if (flows[i].fd < 0) die("server on port %d: accept failed: %s", a->port, strerror(errno));
    tune(flows[i].fd, 0);
    pace(flows[i].fd, a->bytes, a->pace_seconds);
    snprintf(flows[i].name, sizeof(flows[i].name), "worker %s", inet_ntoa(peer.sin_addr));
    flows[i].expect = a->bytes * a->steps;
  }
  close(lfd);
  double wall0 = now(), cpu0 = cpu_seconds();
  char what[64];
  snprintf(what, sizeof(what), "server on port %d", a->port);
  run(flows, a->workers, a, serve_rule, NULL, deadline, what);
  printf("RESULT {\"served\": %d, \"bytes_each_way\": %lld, \"cpu\": {\"process_cores\": %.3f}}\n", a->workers,
         (long long)(a->bytes * a->steps), (cpu_seconds() - cpu0) / (now() - wall0));
}

static int connect_to(const char* host, int port, int buffer_bytes, double deadline) {
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port)};
  if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) die("worker: %s is not an IPv4 address", host);
  for (;;) {  // the server may still be starting: retry until the deadline
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    tune(fd, buffer_bytes);  // before the handshake: the window scale is agreed there
    struct timeval most = {.tv_sec = 1};  // a blocking connect waits at most this (SO_SNDTIMEO bounds it on Linux)
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &most, sizeof(most));
    if (connect(fd, (struct sockaddr*)&addr, sizeof(addr)) == 0) return fd;
    int why = errno;
    close(fd);
    if (now() > deadline) die("no connection to server %s:%d by the deadline: %s", host, port, strerror(why));
    usleep(50000);
  }
}

static void push(const Args* a) {
  double deadline = now() + a->timeout;
  static Flow flows[kMaxFlows];
  int n = 0;
  char* list = strdup(a->servers);
  for (char* entry = strtok(list, ","); entry; entry = strtok(NULL, ",")) {
    char host[64];
    int port;
    long long share;
    int buf = a->buffer_bytes;
    if (n == kMaxFlows || sscanf(entry, "%63[^:]:%d:%lld:%d", host, &port, &share, &buf) < 3 || share <= 0)
      die("worker: bad --servers entry %s (want ip:port:bytes[:buffer bytes])", entry);
    flows[n].fd = connect_to(host, port, buf, deadline);
    snprintf(flows[n].name, sizeof(flows[n].name), "server %s:%d", host, port);
    flows[n].share = share;
    pace(flows[n].fd, share, a->pace_seconds);
    flows[n].expect = share * a->steps;
    ++n;
  }
  free(list);
  static Steps steps;
  long long busy0, total0, busy1, total1;
  machine_jiffies(&busy0, &total0);
  double wall0 = now(), cpu0 = cpu_seconds();
  run(flows, n, a, push_rule, &steps, deadline, "worker");
  double cores = (cpu_seconds() - cpu0) / (now() - wall0);
  machine_jiffies(&busy1, &total1);
  int timed = strcmp(a->mode, "free") == 0 ? a->steps : a->steps - a->warmup;
  printf("RESULT {\"seconds_per_step\": %.6f, \"cpu\": {\"process_cores\": %.3f, \"machine_busy\": %.3f}, \"steps\": [",
         (steps.ends[a->steps - 1] - steps.timed_from) / timed, cores,
         (double)(busy1 - busy0) / (total1 > total0 ? total1 - total0 : 1));
  double from = steps.timed_from;  // rounds: each timed step's seconds (free mode has no steps)
  for (int i = a->steps - timed; strcmp(a->mode, "free") != 0 && i < a->steps; from = steps.ends[i++])
    printf("%s%.4f", i > a->steps - timed ? ", " : "", steps.ends[i] - from);
  printf("]}\n");
}

int main(int argc, char** argv) {
  Args a = {.mode = "rounds", .steps = 7, .warmup = 2, .partition = 128 << 10, .timeout = 300};
  if (argc < 2 || (strcmp(argv[1], "serve") && strcmp(argv[1], "push"))) die("usage: tcp_matrix serve|push [options]");
  a.role = argv[1];
  for (int i = 2; i < argc; i += 2) {
    if (i + 1 >= argc) die("%s needs a value", argv[i]);
    const char *k = argv[i], *v = argv[i + 1];
    if (!strcmp(k, "--mode")) a.mode = v;
    else if (!strcmp(k, "--servers")) a.servers = v;
    else if (!strcmp(k, "--port")) a.port = atoi(v);
    else if (!strcmp(k, "--workers")) a.workers = atoi(v);
    else if (!strcmp(k, "--bytes")) a.bytes = atoll(v);
    else if (!strcmp(k, "--steps")) a.steps = atoi(v);
    else if (!strcmp(k, "--warmup")) a.warmup = atoi(v);
    else if (!strcmp(k, "--partition-bytes")) a.partition = atoll(v);
    else if (!strcmp(k, "--socket-buffer-bytes")) a.buffer_bytes = atoi(v);
    else if (!strcmp(k, "--timeout")) a.timeout = atof(v);
    else if (!strcmp(k, "--pace-seconds")) a.pace_seconds = atof(v);
    else if (!strcmp(k, "--lead-bytes")) a.lead = atoll(v);
    else die("unknown option %s", k);
  }
  if (strcmp(a.mode, "rounds") && strcmp(a.mode, "free")) die("--mode %s: want rounds or free", a.mode);
  if (a.steps < 1 || a.steps > 1024 || a.warmup < 0 || a.warmup >= a.steps)
    die("--steps %d, --warmup %d: want 0 <= warmup < steps <= 1024", a.steps, a.warmup);
  if (a.partition <= 0 || !(a.timeout > 0) || a.lead < 0)
    die("--partition-bytes and --timeout must be positive, --lead-bytes not negative");
  if (!strcmp(a.role, "serve")) {
    if (a.port <= 0 || a.workers <= 0 || a.workers > kMaxFlows || a.bytes <= 0)
      die("serve needs --port, --workers (1..%d) and --bytes", kMaxFlows);
    serve(&a);
  } else {
    if (!a.servers) die("push needs --servers");
    push(&a);
  }
  return 0;
}
