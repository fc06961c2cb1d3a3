// Test certificates made at test time with the openssl CLI (nothing private is committed): a CA,
// a server certificate for localhost / 127.0.0.1 signed by it, a client certificate signed by it,
// and a second, unrelated CA with its own client certificate (which a mutual-TLS server must
// refuse). EC P-256 keys, valid for 2 days.
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace fsdp8::testing {

struct TestCerts {
  std::string dir;
  std::string ca, server_cert, server_key, client_cert, client_key;
  std::string other_ca, other_client_cert, other_client_key;
};

// Writes the certificates into `dir`; false (with a gtest failure naming the command) on error.
inline bool MakeTestCerts(const std::string& dir, TestCerts* out) {
  auto run = [&](const std::string& cmd) {
    const std::string full = "cd '" + dir + "' && " + cmd + " >>openssl.log 2>&1";
    if (std::system(full.c_str()) != 0) {
      ADD_FAILURE() << "failed (is the openssl CLI installed?): " << cmd;
      return false;
    }
    return true;
  };
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  auto ca = [&](const std::string& name) {
    return run("openssl req -x509 " + key + " -keyout " + name + ".key -out " + name +
               ".crt -days 2 -subj /CN=" + name +
               " -addext basicConstraints=critical,CA:TRUE"
               " -addext keyUsage=critical,keyCertSign,cRLSign");
  };
  auto leaf = [&](const std::string& name, const std::string& ca_name, const std::string& cn,
                  const std::string& ext) {
    std::ofstream(dir + "/" + name + ".ext") << ext << "\n";
    return run("openssl req " + key + " -keyout " + name + ".key -out " + name + ".csr -subj /CN=" +
               cn) &&
           run("openssl x509 -req -in " + name + ".csr -CA " + ca_name + ".crt -CAkey " + ca_name +
               ".key -CAcreateserial -out " + name + ".crt -days 2 -extfile " + name + ".ext");
  };
  if (!ca("ca") || !ca("other-ca")) return false;
  if (!leaf("server", "ca", "localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"))
    return false;
  if (!leaf("client", "ca", "fsdp8-client", "extendedKeyUsage=clientAuth")) return false;
  if (!leaf("other-client", "other-ca", "fsdp8-client", "extendedKeyUsage=clientAuth")) return false;
  out->dir = dir;
  out->ca = dir + "/ca.crt";
  out->server_cert = dir + "/server.crt";
  out->server_key = dir + "/server.key";
  out->client_cert = dir + "/client.crt";
  out->client_key = dir + "/client.key";
  out->other_ca = dir + "/other-ca.crt";
  out->other_client_cert = dir + "/other-client.crt";
  out->other_client_key = dir + "/other-client.key";
  return true;
}

}  // namespace fsdp8::testing
