# Worker image: fsdp8-worker with the CUDA backend (cuBLASLt FP8 GEMMs, NCCL, cuDNN attention) on
# NVIDIA's CUDA runtime base, plus the fsdp8 CLI for the preStop hook. The CUDA libraries come from
# the base image (matched to the node's driver through the NVIDIA container toolkit); the other
# shared libraries are bundled from the build stage (scripts/bundle-deps.sh).
# Build from the repository root (Hopper GPUs: sm_90a):
#   docker build -f deploy/worker.Dockerfile -t fsdp8/worker:0.1.0-cuda13 .
ARG CUDA_IMAGE_TAG=13.0.1-cudnn
FROM nvidia/cuda:${CUDA_IMAGE_TAG}-devel-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive
COPY scripts/install-deps.sh /src/scripts/install-deps.sh
RUN FSDP8_BUILD_ONLY=1 bash /src/scripts/install-deps.sh \
 && python3 -m pip install --break-system-packages --no-deps nvidia-cudnn-frontend==1.32.0
COPY . /src
WORKDIR /src
# -O2 without -g: the code of RelWithDebInfo, whose debug info the image would strip anyway. Only
# with a compiler cache mounted at /ccache: as in coordinator.Dockerfile (scripts/build.sh's flags,
# the host's objects reused, the debug info stripped).
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
           -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache; \
    else set -- -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O2 -DNDEBUG" \
           -DCMAKE_C_FLAGS_RELEASE="-O2 -DNDEBUG" -DCMAKE_CUDA_FLAGS_RELEASE="-O2 -DNDEBUG"; fi \
 && cmake -S . -B build -G Ninja -DFSDP8_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a "$@" \
 && cmake --build build --target fsdp8-worker fsdp8 \
 && scripts/bundle-deps.sh /out build/bin/fsdp8-worker build/bin/fsdp8 \
 && if [ -d /ccache ]; then strip --strip-debug /out/fsdp8*; ccache --show-log-stats; fi

FROM nvidia/cuda:${CUDA_IMAGE_TAG}-runtime-ubuntu24.04
# deploy/build-images.sh passes the version (CMakeLists.txt) and the commit.
ARG FSDP8_VERSION=0.1.0
ARG FSDP8_COMMIT=unknown
LABEL org.opencontainers.image.title="fsdp8-worker" \
      org.opencontainers.image.description="fsdp8 worker with the CUDA backend, and the CLI" \
      org.opencontainers.image.version="${FSDP8_VERSION}" \
      org.opencontainers.image.revision="${FSDP8_COMMIT}"
COPY --from=build /out/lib/ /usr/local/lib/fsdp8/
COPY --from=build /out/fsdp8-worker /out/fsdp8 /usr/local/bin/
ENV LD_LIBRARY_PATH=/usr/local/lib/fsdp8:${LD_LIBRARY_PATH} \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
EXPOSE 50052
ENTRYPOINT ["/usr/local/bin/fsdp8-worker"]
