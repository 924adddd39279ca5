{{/*
Names, labels and the one shape every ARL service's pod has. Each service's own template
(controller.yaml … trainer.yaml) gives only what is its own: flags, ports, volumes.
*/}}

{{- define "arl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "arl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of everything the chart renders; "component" names the part. */}}
{{- define "arl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "arl.selectorLabels" . }}
app.kubernetes.io/part-of: arl
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{- define "arl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "arl.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "arl.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Where sandbox Pods live: sandbox.kube.namespace, else the release's namespace. */}}
{{- define "arl.sandboxNamespace" -}}
{{- default .Release.Namespace .Values.sandbox.kube.namespace }}
{{- end }}

{{/* The ServiceAccount sandbox Pods run as (no API access). */}}
{{- define "arl.sandboxPodServiceAccount" -}}
{{- printf "%s-sandbox-pod" (include "arl.fullname" .) }}
{{- end }}

{{/* The SandboxSet sandboxes are claimed from, or "" when Pods are created directly. */}}
{{- define "arl.sandboxSetName" -}}
{{- with .Values.sandbox.kube.sandboxSet }}
{{- if .enabled }}
{{- if .create }}
{{- printf "%s-sandboxes" (include "arl.fullname" $) }}
{{- else }}
{{- required "sandbox.kube.sandboxSet.name: name the existing SandboxSet (or set create: true)" .name }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "arl.natsUrl" -}}
{{- printf "%s://%s-nats.%s.svc.%s:4222" (ternary "tls" "nats" .Values.nats.tls.enabled) (include "arl.fullname" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* The proxy's address as sandboxes reach it (its Service). */}}
{{- define "arl.proxyUrl" -}}
{{- printf "http://%s-proxy.%s.svc.%s:%d" (include "arl.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.proxy.port) }}
{{- end }}

{{/*
The least-privilege permissions of every role, generated from arl_schemas::permissions
(schemas/tests/chart_permissions.rs keeps files/permissions.json true to the Rust source).
*/}}
{{- define "arl.permissions" -}}
{{- (.Files.Get "files/permissions.json" | fromJson).roles | toJson }}
{{- end }}

{{/* The environment variable NATS reads a role's password from (nats.conf's $VAR). */}}
{{- define "arl.passwordVar" -}}
{{- printf "ARL_NATS_PASSWORD_%s" (upper .) }}
{{- end }}

{{- define "arl.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .uid }}
runAsGroup: {{ .uid }}
fsGroup: {{ .uid }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "arl.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .uid }}
runAsGroup: {{ .uid }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{/*
Environment every ARL service gets: the bus (URL, its role's user, inbox prefix, CA), the
ops address, stream replicas, logs, traces, and the pod's own name and address.
*/}}
{{- define "arl.commonEnv" -}}
{{- $root := .root -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: NATS_URL
  value: {{ include "arl.natsUrl" $root | quote }}
{{- if $root.Values.nats.auth.enabled }}
- name: NATS_USER
  value: {{ .role | quote }}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "arl.fullname" $root }}-nats-auth
      key: {{ .role }}
- name: NATS_INBOX_PREFIX
  value: {{ printf "_INBOX_%s" .role | quote }}
{{- end }}
{{- if $root.Values.nats.tls.enabled }}
- name: NATS_CA
  value: /etc/arl/nats-tls/ca.crt
{{- end }}
- name: ARL_HTTP_ADDR
  value: "0.0.0.0:9090"
- name: ARL_STREAM_REPLICAS
  value: {{ $root.Values.nats.jetstream.replicas | quote }}
{{- with $root.Values.nats.jetstream.maxBytesPerStream }}
- name: ARL_STREAM_MAX_BYTES
  value: {{ int64 . | toString | quote }}
{{- end }}
- name: RUST_LOG
  value: {{ $root.Values.logLevel | quote }}
- name: ARL_LOG_FORMAT
  value: {{ $root.Values.logFormat | quote }}
- name: HOME
  value: /tmp
{{- if $root.Values.otel.enabled }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ printf "http://%s-otel-collector:4318" (include "arl.fullname" $root) | quote }}
{{- end }}
{{- end }}

{{/*
One ARL service: its ServiceAccount, its Service (the `metrics` port, plus its API), and
its Deployment (or StatefulSet). Arguments (a dict):
  root        the chart's context
  service     the service's name (also its NATS role and component label)
  args        flags after `arl serve <service>`
  ports       [{name, port}] the container serves besides 9090; "opsPort" names the one
              answering /health, /ready and /metrics (9090 "ops" when not given)
  opsPort     name of that port
  env         extra EnvVars
  volumes / volumeMounts   extra ones (/tmp is always a private emptyDir)
  gpu         schedule on GPU nodes and request .count GPUs (the service's gpu block)
  kind        Deployment (default) or StatefulSet
  automount   mount an API token (services with a Role)
  autoscaled  an HPA owns the replica count
*/}}
{{- define "arl.service" -}}
{{- $root := .root }}
{{- $name := .service }}
{{- $values := index $root.Values $name }}
{{- $full := printf "%s-%s" (include "arl.fullname" $root) $name }}
{{- $component := dict "root" $root "component" $name }}
{{- $opsPort := default "ops" .opsPort }}
{{- $kind := default "Deployment" .kind }}
{{- $gpu := and .gpu .gpu.enabled }}
{{- $ports := .ports | default list }}
{{- if eq $opsPort "ops" }}
{{- $ports = prepend $ports (dict "name" "ops" "port" 9090) }}
{{- end }}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ $full }}
  labels:
    {{- include "arl.labels" $component | nindent 4 }}
automountServiceAccountToken: {{ .automount | default false }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $full }}
  labels:
    {{- include "arl.labels" $component | nindent 4 }}
    arl.dev/metrics: "true"
spec:
  {{- if eq $kind "StatefulSet" }}
  # Headless: each engine is addressed by its own name (<pod>.<service>).
  clusterIP: None
  publishNotReadyAddresses: true
  {{- end }}
  selector:
    {{- include "arl.selectorLabels" $component | nindent 4 }}
  ports:
    {{- range $ports }}
    # /metrics is served on "metrics" (9090), or on "api" by the services that serve
    # their ops routes beside their API (inference, proxy, sandbox).
    - name: {{ ternary "metrics" .name (eq .name "ops") }}
      port: {{ .port }}
      targetPort: {{ .name }}
      protocol: TCP
    {{- end }}
---
apiVersion: apps/v1
kind: {{ $kind }}
metadata:
  name: {{ $full }}
  labels:
    {{- include "arl.labels" $component | nindent 4 }}
spec:
  {{- if not .autoscaled }}
  replicas: {{ $values.replicas }}
  {{- end }}
  {{- if eq $kind "StatefulSet" }}
  serviceName: {{ $full }}
  podManagementPolicy: Parallel
  {{- else if $gpu }}
  # A GPU pod's replacement waits for its GPU: stop the old one first.
  strategy:
    type: Recreate
  {{- else if .recreate }}
  # One holder at a time (the exporter's feeds): stop the old one first.
  strategy:
    type: Recreate
  {{- end }}
  selector:
    matchLabels:
      {{- include "arl.selectorLabels" $component | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "arl.labels" $component | nindent 8 }}
      {{- with $values.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ $full }}
      automountServiceAccountToken: {{ .automount | default false }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- range . }}
        - name: {{ . }}
        {{- end }}
      {{- end }}
      securityContext:
        {{- include "arl.podSecurityContext" (dict "uid" $root.Values.runAsUser) | nindent 8 }}
      # Services drain on SIGTERM (in-flight handlers finish, telemetry is flushed).
      terminationGracePeriodSeconds: {{ ternary 120 60 (or $gpu (eq $name "rollout")) }}
      {{- $nodeSelector := $values.nodeSelector }}
      {{- if $gpu }}
      {{- $nodeSelector = merge (deepCopy $values.nodeSelector) $root.Values.gpu.nodeSelector }}
      {{- end }}
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $tolerations := $values.tolerations }}
      {{- if $gpu }}
      {{- $tolerations = concat $values.tolerations $root.Values.gpu.tolerations }}
      {{- end }}
      {{- with $tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $values.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $name }}
          image: {{ include "arl.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: [/usr/local/bin/arl]
          args:
            - serve
            - {{ $name }}
            {{- range .args }}
            - {{ . | quote }}
            {{- end }}
            {{- range $values.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "arl.commonEnv" (dict "root" $root "role" $name) | nindent 12 }}
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- range $ports }}
            - name: {{ .name }}
              containerPort: {{ .port }}
              protocol: TCP
            {{- end }}
          # Up: the process answers and holds its NATS connection (a restart is the cure
          # only after two minutes of either failing).
          livenessProbe:
            httpGet: {path: /health, port: {{ $opsPort }}}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 12
          # Ready: the service can do its work (weights loaded, a healthy backend, …).
          readinessProbe:
            httpGet: {path: /ready, port: {{ $opsPort }}}
            periodSeconds: 5
            timeoutSeconds: 5
            failureThreshold: 3
          # Loading a model or probing a GPU may take minutes before /health answers.
          startupProbe:
            httpGet: {path: /health, port: {{ $opsPort }}}
            periodSeconds: 5
            timeoutSeconds: 5
            failureThreshold: {{ ternary 180 60 (or $gpu (eq $name "inference") (eq $name "trainer")) }}
          resources:
            {{- $resources := deepCopy $values.resources }}
            {{- if $gpu }}
            {{- $limits := default (dict) $resources.limits }}
            {{- $_ := set $limits $root.Values.gpu.resourceName (int .gpu.count) }}
            {{- $_ := set $resources "limits" $limits }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- include "arl.containerSecurityContext" (dict "uid" $root.Values.runAsUser) | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if $root.Values.nats.tls.enabled }}
            - name: nats-tls
              mountPath: /etc/arl/nats-tls
              readOnly: true
            {{- end }}
            {{- with .volumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- if $root.Values.nats.tls.enabled }}
        - name: nats-tls
          secret:
            secretName: {{ required "nats.tls.secretName: the Secret with the NATS certificate and ca.crt" $root.Values.nats.tls.secretName }}
            items:
              - {key: ca.crt, path: ca.crt}
        {{- end }}
        {{- with .volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}

{{/* A volume of a PVC the chart makes (or an existing one): dict root, name, key. */}}
{{- define "arl.claimVolume" -}}
{{- $p := index .root.Values.persistence .key }}
name: {{ .name }}
persistentVolumeClaim:
  claimName: {{ default (printf "%s-%s" (include "arl.fullname" .root) .name) $p.existingClaim }}
  {{- if .readOnly }}
  readOnly: true
  {{- end }}
{{- end }}
