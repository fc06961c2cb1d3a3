# Coordinator image, no CUDA: fsdp8-coordinator, the fsdp8 CLI (also run by the workers' preStop
# hook) and the CPU worker (CPU-only deployments, deploy/k8s/overlays/cpu-dev).
# Build from the repository root:
#   docker build -f deploy/coordinator.Dockerfile -t fsdp8/coordinator:0.1.0 .
FROM debian:12 AS build
COPY scripts/install-deps.sh /src/scripts/install-deps.sh
RUN FSDP8_BUILD_ONLY=1 bash /src/scripts/install-deps.sh
COPY . /src
WORKDIR /src
# -O2 without -g: the code of RelWithDebInfo, whose debug info the image would strip anyway. Only
# with a compiler cache mounted at /ccache (deploy/build-images.sh: `podman build -v
# HOST_CACHE:/ccache`, the cache scripts/build.sh fills) it compiles as scripts/build.sh does
# (RelWithDebInfo, paths relative to the source tree) to reuse the host's objects, and strips the
# debug info.
# The host's locale, which ccache hashes (deploy/build-images.sh passes it with the cache; unset
# otherwise).
ARG LANG
ARG LC_ALL
ARG LC_CTYPE
ARG LC_MESSAGES
RUN if [ -d /ccache ]; then \
      export CCACHE_DIR=/ccache CCACHE_BASEDIR=/src CCACHE_NOHASHDIR=1 \
             CCACHE_STATSLOG=/tmp/ccache.log \
      && set -- -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER_LAUNCHER=ccache \
           -DCMAKE_CXX_COMPILER_LAUNCHER=ccache; \
    else set -- -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
           -DCMAKE_C_FLAGS_RELEASE="-O2 -DNDEBUG"; fi \
 && cmake -S . -B build -G Ninja -DFSDP8_CUDA=OFF "$@" \
 && cmake --build build --target fsdp8-coordinator fsdp8-worker fsdp8 \
 && scripts/bundle-deps.sh /out build/bin/fsdp8-coordinator build/bin/fsdp8-worker build/bin/fsdp8 \
 && if [ -d /ccache ]; then strip --strip-debug /out/fsdp8*; ccache --show-log-stats; fi

FROM debian:12-slim
# deploy/build-images.sh passes the version (CMakeLists.txt) and the commit.
ARG FSDP8_VERSION=0.1.0
ARG FSDP8_COMMIT=unknown
LABEL org.opencontainers.image.title="fsdp8-coordinator" \
      org.opencontainers.image.description="fsdp8 coordinator, CLI and CPU worker" \
      org.opencontainers.image.version="${FSDP8_VERSION}" \
      org.opencontainers.image.revision="${FSDP8_COMMIT}"
# The binaries with the shared libraries they were linked against (scripts/bundle-deps.sh).
COPY --from=build /out/lib/ /usr/local/lib/fsdp8/
COPY --from=build /out/fsdp8-coordinator /out/fsdp8-worker /out/fsdp8 /usr/local/bin/
# Chart.js (libjs-chart.js) for the status page's charts.
COPY --from=build /usr/share/javascript/chart.js/ /usr/share/javascript/chart.js/
ENV LD_LIBRARY_PATH=/usr/local/lib/fsdp8
# --version: every bundled library resolves.
RUN fsdp8-coordinator --version >/dev/null && fsdp8-worker --version >/dev/null \
  && groupadd --gid 65532 fsdp8 \
  && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin fsdp8 \
  && mkdir -p /var/lib/fsdp8 && chown 65532:65532 /var/lib/fsdp8
USER 65532:65532
EXPOSE 50051
ENTRYPOINT ["/usr/local/bin/fsdp8-coordinator"]
CMD ["--listen=0.0.0.0:50051", "--state_db=/var/lib/fsdp8/jobs.db", "--data_roots=/data"]
