# fp4moe — thin wrapper around CMake.
#   make run    install missing dependencies, build, run the main job
#   make test   build and run every test
#   make install PREFIX=P   build, then install into P (default /usr/local;
#               DESTDIR is honoured): bin/fp4moe, lib/libfp4moe.{a,so},
#               include/fp4moe.h (+ include/fp4moe/), pkg-config and CMake package files,
#               share/fp4moe/configs
BUILD ?= build
JOBS  ?= $(shell nproc)
CMAKE_FLAGS ?=
FP4MOE = $(BUILD)/fp4moe
PREFIX ?= /usr/local

.PHONY: all deps build run test test-asan fuzz install clean

all: build

deps:
	@scripts/deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

run: deps build
	@scripts/main_job.sh $(FP4MOE)

test: deps build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

install: build
	DESTDIR="$(DESTDIR)" cmake --install $(BUILD) --prefix "$(PREFIX)"

# The same suite with AddressSanitizer + UBSan (CPU code; CUDA off).
test-asan: deps
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DFM_SANITIZE=ON -DFM_CUDA=OFF
	cmake --build build-asan -j $(JOBS)
	cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

# libFuzzer targets, each run for FUZZ_SECONDS.
FUZZ_SECONDS ?= 30
fuzz: deps
	CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DFM_FUZZ=ON -DFM_CUDA=OFF
	cmake --build build-fuzz -j $(JOBS) --target fuzzers
	scripts/run_fuzz.sh build-fuzz $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD) build-asan build-fuzz
